#include "cli/args.hpp"

#include "core/error.hpp"
#include "core/suggest.hpp"

#include <algorithm>
#include <sstream>

namespace plm::cli {

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_member.find(name);
  if (it == values_member.end() || it->second.empty()) return fallback;
  return it->second.back();
}

std::vector<std::string> Args::all(const std::string& name) const {
  auto it = values_member.find(name);
  return it == values_member.end() ? std::vector<std::string>{} : it->second;
}

Parser::Parser(std::string command, std::string usage, std::string description)
    : command_member(std::move(command)),
      usage_member(std::move(usage)),
      description_member(std::move(description)) {
  option({"help", "", "print this help and exit"});
}

Parser& Parser::option(OptionSpec spec) {
  options_member.push_back(std::move(spec));
  return *this;
}

Args Parser::parse(const std::vector<std::string>& argv) const {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.size() < 3 || a.compare(0, 2, "--") != 0) {
      args.positional_member.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto spec = std::find_if(options_member.begin(), options_member.end(),
                             [&](const OptionSpec& o) { return o.name == name; });
    if (spec == options_member.end()) {
      std::vector<std::string> names;
      for (const auto& o : options_member) names.push_back(o.name);
      std::string hint = closestName(name, names);
      throw collectiveError(command_member + ": unknown option --" + name +
                            (hint.empty() ? "" : " (did you mean --" + hint + "?)") + "; see `" +
                            command_member + " --help`");
    }
    if (spec->value_name.empty()) {
      if (inline_value)
        throw collectiveError(command_member + ": option --" + name + " takes no value");
      args.values_member[name].push_back("");
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argv.size())
        throw collectiveError(command_member + ": option --" + name + " needs a value (" +
                              spec->value_name + ")");
      value = argv[++i];
    }
    auto& slot = args.values_member[name];
    if (!slot.empty() && !spec->repeated)
      throw collectiveError(command_member + ": option --" + name + " given more than once");
    slot.push_back(value);
  }
  return args;
}

namespace {
/// `text` broken at spaces into lines of at most `width` columns; lines after the first start
/// with `indent` spaces. Newlines in `text` are kept.
std::string wrap(const std::string& text, size_t width, size_t indent) {
  std::string out;
  std::istringstream paragraphs(text);
  std::string paragraph;
  bool first_line = true;
  while (std::getline(paragraphs, paragraph)) {
    std::istringstream words(paragraph);
    std::string word, line;
    auto flush = [&] {
      out += (first_line ? "" : "\n" + std::string(indent, ' ')) + line;
      first_line = false;
      line.clear();
    };
    while (words >> word) {
      if (!line.empty() && indent + line.size() + 1 + word.size() > width) flush();
      line += (line.empty() ? "" : " ") + word;
    }
    flush();
  }
  return out;
}
}  // namespace

std::string Parser::help() const {
  constexpr size_t width = 100, column = 30;
  std::ostringstream os;
  os << "usage: " << usage_member << "\n\n"
     << wrap(description_member, width, 0) << "\n\noptions:\n";
  for (const auto& o : options_member) {
    std::string left = "  --" + o.name + (o.value_name.empty() ? "" : " " + o.value_name);
    os << left;
    if (left.size() < column)
      os << std::string(column - left.size(), ' ');
    else
      os << "\n" << std::string(column, ' ');
    os << wrap(o.help + (o.repeated ? " (repeatable)" : ""), width, column) << "\n";
  }
  return os.str();
}

}  // namespace plm::cli
