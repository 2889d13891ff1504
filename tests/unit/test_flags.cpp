// The one command-line parser of every subcommand (cli/flags.h): values, switches, operands,
// errors that name the flag, and the --help text generated from the same table.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/flags.h"

namespace fm::cli {
namespace {

const CommandSpec kSpec{"demo",
                        "does a demo\nin two lines",
                        {{"config", "FILE", "the YAML", true},
                         {"threads", "N", "kernel threads\nall cores when absent"},
                         {"json", nullptr, "JSON out"}},
                        "DIR"};

Result<Flags> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "demo");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseFlags(kSpec, static_cast<int>(argv.size()), argv.data());
}

std::string Error(std::vector<std::string> args) {
  const Result<Flags> f = Parse(std::move(args));
  return f.ok() ? "ok" : f.status().message();
}

TEST(Flags, ValuesSwitchesAndTheOperand) {
  const Result<Flags> f = Parse({"--config", "a.yaml", "out", "--threads=3", "--json"});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->Get("config"), "a.yaml");
  EXPECT_EQ(f->operand(), "out");
  EXPECT_TRUE(f->Has("json"));
  EXPECT_FALSE(f->Has("log-level"));
  EXPECT_EQ(*f->GetInt("threads", 0, 1), 3);
  EXPECT_EQ(*f->GetInt("absent", 7), 7);
  EXPECT_EQ(f->Get("absent", "fallback"), "fallback");
}

TEST(Flags, ErrorsNameTheFlag) {
  EXPECT_EQ(Error({"--config", "a", "d", "--bogus"}), "unknown option --bogus");
  EXPECT_EQ(Error({"--config", "a", "d", "--bogus=1"}), "unknown option --bogus");
  EXPECT_EQ(Error({"d", "--config"}), "--config needs a value");
  EXPECT_EQ(Error({"--config", "a", "--config", "b", "d"}), "--config given twice");
  EXPECT_EQ(Error({"--config", "a", "d", "--json", "--json"}), "ok");   // a switch may repeat
  EXPECT_EQ(Error({"--config", "a", "d", "e"}), "unexpected argument 'e'");
  EXPECT_EQ(Error({"--config", "a", "d", "--json=yes"}), "--json takes no value");
  EXPECT_EQ(Error({"d"}), "--config is required");
  EXPECT_EQ(Error({"--config", "a"}), "DIR is required");
  EXPECT_EQ(Error({"--help"}), "ok");   // help needs nothing else
}

TEST(Flags, NumbersAreCheckedAgainstTheirRange) {
  const Result<Flags> f = Parse({"--config", "x", "d", "--threads", "0"});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->GetInt("threads", 1, 1).status().message(), "--threads: '0' is not an integer >= 1");
  EXPECT_EQ(f->GetInt("threads", 1, 1, 8).status().message(),
            "--threads: '0' is not an integer in [1, 8]");
  EXPECT_EQ(*f->GetInt("threads", 1, 0, 8), 0);
  const Result<Flags> g = Parse({"--config", "x", "d", "--threads", "2x"});
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->GetInt("threads", 1).ok());
  EXPECT_EQ(g->GetFloat("threads", 1).status().message(), "--threads: '2x' is not a number");
  const Result<Flags> h = Parse({"--config", "x", "d", "--threads", "0.7"});
  EXPECT_EQ(*h->GetFloat("threads", 1), 0.7f);
}

TEST(Flags, SeedsTakeTheWholeUnsigned64BitRange) {
  const Result<Flags> f = Parse({"--config", "x", "d", "--threads", "18446744073709551615"});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f->GetSeed("threads"), 18446744073709551615ull);
  EXPECT_EQ(*f->GetSeed("absent"), 0u);
  const Result<Flags> g = Parse({"--config", "x", "d", "--threads", "18446744073709551616"});
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->GetSeed("threads").status().message(),
            "--threads: '18446744073709551616' is not an integer in [0, 2^64)");
  const Result<Flags> h = Parse({"--config", "x", "d", "--threads", "-1"});
  EXPECT_FALSE(h->GetSeed("threads").ok());
}

TEST(Flags, TokenIdLists) {
  EXPECT_EQ(*ParseTokenIds("tokens", "3,17,42"), (std::vector<int32_t>{3, 17, 42}));
  EXPECT_EQ(ParseTokenIds("tokens", "3,,4").status().message(),
            "--tokens[1]: '' is not a token id (an integer in [0, 2147483647])");
  EXPECT_EQ(ParseTokenIds("tokens", "-1").status().message(),
            "--tokens[0]: '-1' is not a token id (an integer in [0, 2147483647])");
  EXPECT_FALSE(ParseTokenIds("tokens", "2147483648").ok());
}

TEST(Flags, HelpIsGeneratedFromTheTable) {
  EXPECT_EQ(HelpText(kSpec),
            "usage: flashmesh demo --config FILE [options] DIR\n"
            "  does a demo\n"
            "  in two lines\n"
            "options:\n"
            "  --config FILE      the YAML (required)\n"
            "  --threads N        kernel threads\n"
            "                     all cores when absent\n"
            "  --json             JSON out\n"
            "  --log-level LEVEL  debug|info|warn|error (default info)\n"
            "  --help             this text\n");
}

}  // namespace
}  // namespace fm::cli
