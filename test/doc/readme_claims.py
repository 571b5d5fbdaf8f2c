#!/usr/bin/env python3
"""README.md against the code: what it shows a user must exist.

    readme_claims.py REPO PLM

- every `plm COMMAND` the README shows is a command of `plm --help`, and every `--option` on the
  same line (a code line or an inline code span) is in that command's `plm COMMAND --help` (or is
  one of plm's global options);
- every deck key it names (`section.key`, `section.key: value`, and the keys of its YAML deck)
  is in `plm deck --defaults`, and a value given for a key with a fixed set of values is one of
  them (`plm deck --markdown`: "one of ...");
- every relative link target exists in the tree (the README's and those of the pages of doc/);
- every page under doc/ is linked from the README (its documentation index).
Each failure is one line; the exit status is the number of failures (capped at 100).
"""
import pathlib
import re
import subprocess
import sys

repo = pathlib.Path(sys.argv[1])
plm = sys.argv[2]
readme_path = repo / "README.md"
readme = readme_path.read_text()
failures = []


def fail(msg):
    failures.append(msg)
    print(f"README.md: {msg}")


def run(*args):
    r = subprocess.run([plm, *args], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


# Commands and their options, from the executable itself.
top = run("--help")
commands = set(re.findall(r"^  ([a-z]+) ", top.split("commands:", 1)[-1], re.M))
for required in ("prep", "train", "eval", "convert", "embed", "bench", "deck", "plan"):
    if required not in commands:
        fail(f"`plm --help` does not list the command `{required}` (README's table names it)")
global_opts = set(re.findall(r"(--[a-z][a-z-]*)", top)) | {"--help", "--version", "--log-all-ranks"}
helps = {}


def options_of(command):
    if command not in helps:
        helps[command] = set(re.findall(r"(--[a-z][a-z0-9-]*)", run(command, "--help")))
    return helps[command]


# Code: fenced blocks' lines and inline code spans.
fenced = re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)
code_lines = [line for block in fenced for line in block.splitlines()]
inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", readme, flags=re.S))
checked_commands = 0
for text in code_lines + inline:
    for m in re.finditer(r"(?:^|[\s/(])plm ([a-z]+)\b(.*)", text):
        command, rest = m.group(1), m.group(2)
        if command in ("COMMAND",):
            continue
        if command not in commands:
            fail(f"`plm {command}` is not a plm command (`plm --help` lists {', '.join(sorted(commands))})")
            continue
        checked_commands += 1
        rest = rest.split("#", 1)[0]
        rest = re.split(r"\bplm [a-z]+\b", rest)[0]  # another command on the same line
        for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if opt not in options_of(command) and opt not in global_opts:
                fail(f"`plm {command} ... {opt}`: `plm {command} --help` has no {opt}")
if checked_commands < 8:
    fail(f"only {checked_commands} `plm COMMAND` uses found: the README's command lines were not read")

# Deck keys: the schema from `plm deck --defaults`, the allowed values from `--markdown`.
defaults = run("deck", "--defaults")
keys, section = set(), None
for line in defaults.splitlines():
    m = re.match(r"^([a-z0-9_]+):\s*$", line)
    if m:
        section = m.group(1)
        continue
    m = re.match(r"^  ([a-z0-9_]+):", line)
    if m and section:
        keys.add(f"{section}.{m.group(1)}")
sections = {k.split(".")[0] for k in keys}
if len(keys) < 40:
    fail(f"`plm deck --defaults` gave only {len(keys)} keys: its format was not understood")
allowed = {}
markdown, section = run("deck", "--markdown"), None
for line in markdown.splitlines():
    m = re.match(r"^## `([a-z0-9_]+)`", line)
    if m:
        section = m.group(1)
    m = re.match(r"^\| `([a-z0-9_]+)` \|[^|]*\|[^|]*\| one of ([^|]+) \|", line)
    if m and section:
        allowed[f"{section}.{m.group(1)}"] = {v.strip() for v in m.group(2).split(",")}
named = 0
for text in inline:
    m = re.fullmatch(r"([a-z][a-z0-9_]*)\.([a-z][a-z0-9_]*)(?::\s*(\S+))?", text.strip())
    if not m or m.group(1) not in sections | {"model", "data", "train", "optimizer", "schedule", "checkpoint",
                                               "moe", "fp8", "parallel"}:
        continue
    key = f"{m.group(1)}.{m.group(2)}"
    named += 1
    if key not in keys:
        fail(f"deck key `{key}` is not in `plm deck --defaults`")
    elif m.group(3) and key in allowed and m.group(3) not in allowed[key]:
        fail(f"`{text}`: {key} takes one of {', '.join(sorted(allowed[key]))}")
for block in re.findall(r"```yaml\n(.*?)```", readme, re.S):
    for line in block.splitlines():
        m = re.match(r"^([a-z0-9_]+):\s*\{(.*)\}", line.split("#", 1)[0].strip())
        if not m:
            continue
        for k in re.findall(r"(?:^|,)\s*([a-z0-9_]+)\s*:", m.group(2)):
            named += 1
            if f"{m.group(1)}.{k}" not in keys:
                fail(f"the YAML deck's `{m.group(1)}: {{{k}: ...}}` is not a key of `plm deck --defaults`")
# Keys named inside the prose without a section: `parallel` section's list.
for m in re.finditer(r"`parallel` \(([^)]*)\)", readme):
    for k in re.findall(r"`([a-z_]+)`", m.group(1)):
        named += 1
        if f"parallel.{k}" not in keys:
            fail(f"`parallel` key `{k}` is not in `plm deck --defaults`")
if named < 10:
    fail(f"only {named} deck keys found in the README: the check did not read them")

# Links.
links = re.findall(r"\]\(([^)\s]+)\)", readme)
for target in links:
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
    path = target.split("#", 1)[0]
    if not (repo / path).exists():
        fail(f"link target {path} does not exist")

# The pages of doc/ link only to files that exist too.
for page in sorted(repo.glob("doc/**/*.md")):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            fail(f"{page.relative_to(repo).as_posix()} links to {target}, which does not exist")

# Every page of doc/ is in the index.
linked = {pathlib.PurePosixPath(t.split("#", 1)[0]).as_posix() for t in links}
for page in sorted(repo.glob("doc/**/*.md")):
    rel = page.relative_to(repo).as_posix()
    if rel not in linked:
        fail(f"{rel} is linked from nowhere in the README (add it to the documentation index)")

print(f"README.md: {checked_commands} command uses, {named} deck keys, {len(links)} links checked; "
      f"{len(failures)} problem(s)")
sys.exit(min(len(failures), 100))
