// Input decks: a Teuchos::ParameterList read from YAML or XML and checked against one schema.
//
// The schema (src/deck/schema.cpp) is the single source of truth: every key has a type, a
// default, the values it allows and a doc string. Validation, the commented default deck
// (`plm deck --defaults`), the resolved deck written into the run directory and doc/deck.md
// (`plm deck --markdown`) are all generated from it, so the documentation cannot drift.
//
// Validation is plm's own rather than Teuchos' validateParameters(): a user who mistypes a key
// gets one line naming the key, its section and the closest valid name, never Teuchos text.
//
// Types of a resolved deck, for code that reads it
// (`deck->sublist("optimizer").get<double>("lr")`):
//   int, double, bool, std::string, and Teuchos::Array<double> (optimizer.betas).
#pragma once

#include <Teuchos_ParameterList.hpp>
#include <Teuchos_RCP.hpp>

#include <string>
#include <vector>

namespace plm::deck {

/// \brief Every section and key with its default value and doc string (Teuchos docString),
/// in the order the reference lists them.
Teuchos::RCP<const Teuchos::ParameterList> schema();

/// \brief Reads a deck (.yaml/.yml or .xml), applies `overrides` ("section.key=value"),
/// validates and fills in every default. Throws a collective plm::Error naming the file, the
/// key and what is allowed.
Teuchos::RCP<Teuchos::ParameterList> load(const std::string& path,
                                          const std::vector<std::string>& overrides = {});

/// \brief Validates a user list (sections of keys; values of any scalar type, or text that
/// parses as the key's type), applies overrides and fills in the defaults.
Teuchos::RCP<Teuchos::ParameterList> resolve(const Teuchos::ParameterList& user,
                                             const std::vector<std::string>& overrides = {});

/// \brief The unvalidated list in a deck file (.yaml/.yml/.xml), for tools and tests.
Teuchos::RCP<Teuchos::ParameterList> readFile(const std::string& path);
/// \brief Parses a plain YAML deck (top-level sections, no wrapper key). `source` names it in
/// errors.
Teuchos::RCP<Teuchos::ParameterList> readYamlString(const std::string& text,
                                                    const std::string& source = "deck");
/// \brief Parses a Teuchos XML deck (<ParameterList> of section <ParameterList>s).
Teuchos::RCP<Teuchos::ParameterList> readXmlString(const std::string& text,
                                                   const std::string& source = "deck");

/// \brief A deck as plain YAML (sections, then keys, in the list's order), readable by load().
std::string toYaml(const Teuchos::ParameterList& list);

/// \brief Writes toYaml(list) to `path` (the trainer writes `<run_dir>/deck.yaml`).
void writeResolved(const Teuchos::ParameterList& list, const std::string& path);

/// \brief A complete deck with every default and a `# doc` comment per key.
std::string defaultsYaml();

/// \brief The deck reference in Markdown (doc/deck.md is this text).
std::string referenceMarkdown();

}  // namespace plm::deck
