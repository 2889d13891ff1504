// Subcommands of the one `flashmesh` binary. Each returns the process exit code.
#pragma once

namespace fm::cli {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  // argv[0] is the subcommand name
};

// The table lives in main.cpp; each command is implemented in cli/cmd_<name>.cpp.
int CmdMkmodel(int argc, char** argv);
int CmdInspect(int argc, char** argv);
int CmdServe(int argc, char** argv);
int CmdCoordinator(int argc, char** argv);
int CmdWorker(int argc, char** argv);
int CmdUp(int argc, char** argv);
int CmdStatus(int argc, char** argv);
int CmdHealth(int argc, char** argv);
int CmdDrain(int argc, char** argv);
int CmdPlan(int argc, char** argv);
int CmdGenerate(int argc, char** argv);
int CmdLogits(int argc, char** argv);
int CmdBench(int argc, char** argv);

}  // namespace fm::cli
