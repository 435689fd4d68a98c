// sass_row_path.py's fixture: the source lines its fixture disassembly points at.
int i = 0;
for (;;) {
  ++i;
  if (skip) continue;
  if (i != 8) continue;
}
