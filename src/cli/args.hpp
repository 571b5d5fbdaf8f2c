// Command-line options for plm's subcommands.
//
// Each subcommand declares its options (name, whether it takes a value, whether it repeats,
// help text); parse() checks argv against them and gives one clear error for an unknown
// option (with the closest valid name), a missing value or a missing positional.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace plm::cli {

struct OptionSpec {
  std::string name;        // without the leading "--"
  std::string value_name;  // empty: a flag that takes no value
  std::string help;
  bool repeated = false;
};

class Args {
 public:
  bool has(const std::string& name) const { return values_member.count(name) > 0; }
  /// \brief The single value of `name`, or `fallback` when absent.
  std::string get(const std::string& name, const std::string& fallback = "") const;
  /// \brief All values of a repeated option, in order.
  std::vector<std::string> all(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_member; }

 private:
  friend class Parser;
  std::map<std::string, std::vector<std::string>> values_member;
  std::vector<std::string> positional_member;
};

class Parser {
 public:
  /// `command`: e.g. "plm prep"; `usage`: the synopsis line(s); `description`: a paragraph.
  Parser(std::string command, std::string usage, std::string description);
  Parser& option(OptionSpec spec);
  /// \brief Parses the arguments after the subcommand name. Throws plm::Error (collective) on
  /// bad input. `--help` prints help() and sets helpRequested().
  Args parse(const std::vector<std::string>& argv) const;
  std::string help() const;

 private:
  std::string command_member, usage_member, description_member;
  std::vector<OptionSpec> options_member;
};

}  // namespace plm::cli
