// `moe-harness golden {record,verify,diff,show}`: the CLI layer over golden/golden.h.
//
//   moe-harness golden record [--op NAME | --case LINE] [--max-bytes N] --out DIR
//   moe-harness golden verify PATH... [--impl NAME] [--plugin PATH] [--ties P] [--junit FILE]
//   moe-harness golden diff A B
//   moe-harness golden show FILE
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "golden/golden.h"
#include "tools/commands.h"

namespace moe::tools {

namespace {

// Bad usage (unknown op, unparsable case line) is status 2; everything else the command decides.
template <class F>
int guarded(F&& f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    std::cerr << "moe-harness golden: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe-harness golden: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

void add_golden_command(CLI::App& app, int& status) {
  CLI::App* g = app.add_subcommand(
      "golden", "Record, verify, diff and show moe-golden/1 safetensors files (SPEC §14)");
  g->require_subcommand(1);

  auto rec = std::make_shared<golden::RecordOptions>();
  CLI::App* r = g->add_subcommand(
      "record", "Run the named case catalogue (or one case) through the reference, one file each");
  CLI::Option* op = r->add_option("--op", rec->op, "Only this op's named cases");
  r->add_option("--case", rec->case_line, "Record this one Case line instead of the catalogue")
      ->excludes(op);
  r->add_option("--max-bytes", rec->max_bytes,
                "Skip catalogue cases whose tensors exceed N bytes (0 = no limit)");
  r->add_option("--out", rec->out_dir, "Output directory")->required();
  r->callback(
      [rec, &status] { status = guarded([&] { return golden::record(*rec, std::cout); }); });

  struct VerifyArgs {
    std::vector<std::string> paths;
    std::string backend = "reference", junit, ties = "canonical";
    std::vector<std::string> plugins;
  };
  auto ver = std::make_shared<VerifyArgs>();
  CLI::App* v = g->add_subcommand(
      "verify", "Recompute every file's case from its stored inputs and compare (SPEC §12)");
  v->add_option("paths", ver->paths, "Files, or directories searched for *.safetensors")
      ->required();
  v->add_option("--impl,--backend", ver->backend,
                "Implementation: reference (default), moe-gpu (alias gpu), or a plugin's");
  v->add_option("--plugin", ver->plugins, "Load implementations from this shared library");
  v->add_option("--ties", ver->ties, "Exact-tie rule of top-k selection: canonical, te or any")
      ->check(CLI::IsMember({"canonical", "te", "any"}));
  v->add_option("--junit", ver->junit, "Write JUnit XML here");
  v->callback([ver, &status] {
    status = guarded([&] {
      for (auto& p : ver->plugins) load_plugin(p);
      return golden::verify(ver->paths, ver->backend, ver->junit, std::cout,
                            parse_tie_policy(ver->ties));
    });
  });

  auto pair = std::make_shared<std::vector<std::string>>();
  CLI::App* d = g->add_subcommand("diff", "Compare two files tensor by tensor");
  d->add_option("files", *pair, "A B")->required()->expected(2);
  d->callback([pair, &status] {
    status = guarded([&] { return golden::diff(pair->at(0), pair->at(1), std::cout); });
  });

  auto file = std::make_shared<std::string>();
  CLI::App* s = g->add_subcommand("show", "Metadata and per-tensor summary of one file");
  s->add_option("file", *file, "FILE")->required();
  s->callback(
      [file, &status] { status = guarded([&] { return golden::show(*file, std::cout); }); });
}

}  // namespace moe::tools
