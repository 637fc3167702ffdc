#include "project.h"

#include <algorithm>
#include <functional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "odyssey/env_util.hpp"

namespace odyssey::files {
namespace {

using nlohmann::json;

// The stream projects are drawn from (<odyssey/env_util.hpp>: the same on every platform).
using Rng = env::Xoshiro256;

const std::vector<std::string> kWords = {"apple", "river", "stone", "cloud", "lamp",  "tiger", "paper", "green",
                                         "north", "candle", "maple", "orbit", "pixel", "quartz", "salt", "violet"};
const std::vector<std::string> kModules = {"mathutil", "textkit", "listops", "helpers", "calc", "toolbox"};
const std::vector<std::string> kServices = {"billing", "search", "ingest", "gateway", "notifier", "scheduler"};

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

std::string cased(Rng& rng, const std::string& w) {
  std::string out = w;
  switch (rng.below(3)) {
    case 0: break;
    case 1: out[0] = static_cast<char>(out[0] - 'a' + 'A'); break;
    default:
      for (char& c : out) c = static_cast<char>(c - 'a' + 'A');
  }
  return out;
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string quoted(const std::string& s) { return "'" + replace_all(s, "'", "'\\''") + "'"; }

// ---- Python functions ------------------------------------------------------------------------

// One function task: the code given, the reference code, and test cases computed in C++.
struct PyFunction {
  std::string name;
  std::string given;     // a buggy body or a stub
  std::string solution;  // a correct definition
  json cases = json::array();  // [[args...], expected]
  bool given_fails = false;    // some case's expected value differs from what `given` returns
  std::string hint;            // for TASK.md
};

void add_case(PyFunction& f, json args, json want, const json& given_result) {
  if (want != given_result || want.type() != given_result.type()) f.given_fails = true;
  f.cases.push_back(json::array({std::move(args), std::move(want)}));
}

PyFunction sum_between(Rng& rng) {
  PyFunction f;
  f.name = "sum_between";
  const std::string doc = "    \"\"\"Returns the sum of the integers from a to b, both included (0 when a > b).\"\"\"\n";
  f.given = "def sum_between(a, b):\n" + doc + "    total = 0\n    for n in range(a, b):\n        total += n\n    return total\n";
  f.solution = "def sum_between(a, b):\n" + doc + "    total = 0\n    for n in range(a, b + 1):\n        total += n\n    return total\n";
  auto sum = [](int a, int b) { int64_t t = 0; for (int n = a; n <= b; ++n) t += n; return t; };
  for (int i = 0; i < 6; ++i) {
    const int a = rng.range(-20, 40);
    const int b = a + rng.range(0, 30);
    add_case(f, {a, b}, sum(a, b), sum(a, b - 1));
  }
  const int a = rng.range(5, 30);
  add_case(f, {a, a - rng.range(1, 4)}, 0, 0);
  f.hint = "sum_between gives wrong totals";
  return f;
}

PyFunction count_word(Rng& rng) {
  PyFunction f;
  f.name = "count_word";
  const std::string doc = "    \"\"\"Counts the words of text (separated by whitespace) equal to word, ignoring case.\"\"\"\n";
  f.given = "def count_word(text, word):\n" + doc + "    return text.split().count(word)\n";
  f.solution = "def count_word(text, word):\n" + doc + "    return [w.lower() for w in text.split()].count(word.lower())\n";
  for (int i = 0; i < 6; ++i) {
    std::vector<std::string> words;
    const std::string target = rng.pick(kWords);
    const int n = rng.range(4, 9);
    for (int k = 0; k < n; ++k) words.push_back(cased(rng, rng.chance(0.4) ? target : rng.pick(kWords)));
    std::string text;
    for (const std::string& w : words) text += (text.empty() ? "" : " ") + w;
    const std::string query = cased(rng, target);
    int64_t right = 0, exact = 0;
    for (const std::string& w : words) {
      right += lower(w) == lower(query);
      exact += w == query;
    }
    add_case(f, {text, query}, right, exact);
  }
  add_case(f, {"Salt salt SALT pepper", "salt"}, 3, 1);
  f.hint = "count_word miscounts some words";
  return f;
}

PyFunction clamp(Rng& rng) {
  PyFunction f;
  f.name = "clamp";
  const std::string doc = "    \"\"\"Returns x limited to the range [lo, hi] (lo <= hi).\"\"\"\n";
  f.given = "def clamp(x, lo, hi):\n" + doc + "    return min(lo, max(hi, x))\n";
  f.solution = "def clamp(x, lo, hi):\n" + doc + "    return max(lo, min(hi, x))\n";
  for (int i = 0; i < 7; ++i) {
    const int lo = rng.range(-50, 50);
    const int hi = lo + rng.range(0, 40);
    const int x = rng.range(lo - 30, hi + 30);
    add_case(f, {x, lo, hi}, std::max(lo, std::min(hi, x)), std::min(lo, std::max(hi, x)));
  }
  add_case(f, {5, 0, 10}, 5, 0);
  f.hint = "clamp returns values outside what it should";
  return f;
}

PyFunction is_leap(Rng& rng) {
  PyFunction f;
  f.name = "is_leap";
  const std::string doc =
      "    \"\"\"True for leap years of the Gregorian calendar: divisible by 4, except centuries,\n"
      "    which are leap years only when divisible by 400.\"\"\"\n";
  f.given = "def is_leap(year):\n" + doc + "    return year % 4 == 0 and year % 100 != 0\n";
  f.solution = "def is_leap(year):\n" + doc + "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n";
  std::vector<int> years;
  for (int i = 0; i < 5; ++i) years.push_back(rng.range(1583, 2500));
  years.push_back(rng.range(17, 24) * 100);
  years.push_back(rng.range(4, 6) * 400);
  for (const int y : years)
    add_case(f, {y}, y % 4 == 0 && (y % 100 != 0 || y % 400 == 0), y % 4 == 0 && y % 100 != 0);
  f.hint = "is_leap is wrong for some years";
  return f;
}

PyFunction running_max(Rng& rng) {
  PyFunction f;
  f.name = "running_max";
  const std::string doc = "    \"\"\"Returns the list whose i-th item is the largest of xs[0], ..., xs[i].\"\"\"\n";
  f.given = "def running_max(xs):\n" + doc +
            "    out = []\n    best = 0\n    for x in xs:\n        best = max(best, x)\n        out.append(best)\n    return out\n";
  f.solution = "def running_max(xs):\n" + doc +
               "    out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n    return out\n";
  for (int i = 0; i < 6; ++i) {
    std::vector<int> xs;
    const int n = rng.range(1, 7);
    for (int k = 0; k < n; ++k) xs.push_back(rng.range(-50, 50));
    if (i == 0) xs[0] = -rng.range(1, 50);
    std::vector<int> right, wrong;
    int best = 0;
    for (const int x : xs) {
      right.push_back(right.empty() ? x : std::max(right.back(), x));
      best = std::max(best, x);
      wrong.push_back(best);
    }
    add_case(f, {xs}, right, wrong);
  }
  add_case(f, {json::array()}, json::array(), json::array());
  f.hint = "running_max is wrong for some lists";
  return f;
}

PyFunction chunk(Rng& rng) {
  PyFunction f;
  f.name = "chunk";
  const std::string doc = "    \"\"\"Splits the list xs into consecutive lists of n items (n >= 1); the last may be shorter.\"\"\"\n";
  f.given = "def chunk(xs, n):\n" + doc + "    return [xs[i:i + n] for i in range(0, len(xs) - n + 1, n)]\n";
  f.solution = "def chunk(xs, n):\n" + doc + "    return [xs[i:i + n] for i in range(0, len(xs), n)]\n";
  for (int i = 0; i < 6; ++i) {
    const int n = rng.range(2, 5);
    int len = rng.range(1, 12);
    if (i == 0 && len % n == 0) ++len;
    std::vector<int> xs;
    for (int k = 0; k < len; ++k) xs.push_back(rng.range(0, 99));
    json right = json::array(), wrong = json::array();
    for (int at = 0; at < len; at += n) {
      const std::vector<int> part(xs.begin() + at, xs.begin() + std::min(len, at + n));
      right.push_back(part);
      if (at + n <= len) wrong.push_back(part);
    }
    add_case(f, {xs, n}, right, wrong);
  }
  f.hint = "chunk loses items";
  return f;
}

PyFunction average(Rng& rng) {
  PyFunction f;
  f.name = "average";
  const std::string doc = "    \"\"\"Returns the arithmetic mean of a non-empty list of numbers, as a float.\"\"\"\n";
  f.given = "def average(xs):\n" + doc + "    return sum(xs) // len(xs)\n";
  f.solution = "def average(xs):\n" + doc + "    return sum(xs) / len(xs)\n";
  for (int i = 0; i < 6; ++i) {
    const int n = i % 2 == 0 ? 2 : 4;  // means of 2 or 4 integers are exact in binary
    std::vector<int> xs;
    int64_t total = 0;
    for (int k = 0; k < n; ++k) total += xs.emplace_back(rng.range(-40, 90));
    const int64_t floor_div = total >= 0 ? total / n : -((-total + n - 1) / n);
    add_case(f, {xs}, static_cast<double>(total) / n, floor_div);
  }
  f.hint = "average returns wrong values";
  return f;
}

PyFunction run_length(Rng& rng) {
  PyFunction f;
  f.name = "run_length";
  const std::string def =
      "def run_length(s):\n"
      "    \"\"\"Run-length encodes s: each run of one character becomes the character followed by\n"
      "    the run's length, e.g. run_length(\"aaabcc\") == \"a3b1c2\"; run_length(\"\") == \"\".\"\"\"\n";
  f.given = def + "    raise NotImplementedError(\"run_length\")\n";
  f.solution = def +
               "    out = []\n    i = 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
               "            j += 1\n        out.append(s[i] + str(j - i))\n        i = j\n    return \"\".join(out)\n";
  add_case(f, {""}, "", nullptr);
  for (int i = 0; i < 6; ++i) {
    std::string s;
    const int runs = rng.range(1, 6);
    char last = 0;
    for (int r = 0; r < runs; ++r) {
      char c;
      do c = static_cast<char>('a' + rng.below(5));
      while (c == last);
      last = c;
      s.append(static_cast<size_t>(rng.range(1, 12)), c);
    }
    std::string want;
    for (size_t at = 0; at < s.size();) {
      size_t end = at;
      while (end < s.size() && s[end] == s[at]) ++end;
      want += s[at] + std::to_string(end - at);
      at = end;
    }
    add_case(f, {s}, want, nullptr);
  }
  f.hint = "implement run_length";
  return f;
}

PyFunction caesar(Rng& rng) {
  PyFunction f;
  f.name = "caesar";
  const int k = rng.range(1, 25);
  const std::string def =
      "def caesar(text):\n"
      "    \"\"\"Returns text with every ASCII letter moved " +
      std::to_string(k) +
      " places forward in the alphabet, wrapping\n"
      "    around from z to a and keeping its case; other characters are unchanged.\"\"\"\n";
  f.given = def + "    raise NotImplementedError(\"caesar\")\n";
  f.solution = def + "    out = []\n    for c in text:\n        if \"a\" <= c <= \"z\":\n            out.append(chr((ord(c) - 97 + " +
               std::to_string(k) + ") % 26 + 97))\n        elif \"A\" <= c <= \"Z\":\n            out.append(chr((ord(c) - 65 + " +
               std::to_string(k) + ") % 26 + 65))\n        else:\n            out.append(c)\n    return \"\".join(out)\n";
  const std::vector<std::string> punctuation = {"", ",", "!", "?", " 42", "."};
  for (int i = 0; i < 6; ++i) {
    std::string text;
    const int n = rng.range(1, 4);
    for (int w = 0; w < n; ++w) text += (w ? " " : "") + cased(rng, rng.pick(kWords));
    text += rng.pick(punctuation);
    std::string want = text;
    for (char& c : want) {
      if (c >= 'a' && c <= 'z') c = static_cast<char>('a' + (c - 'a' + k) % 26);
      else if (c >= 'A' && c <= 'Z') c = static_cast<char>('A' + (c - 'A' + k) % 26);
    }
    add_case(f, {text}, want, nullptr);
  }
  add_case(f, {"xyz XYZ"}, [&] {
    std::string w = "xyz XYZ";
    for (char& c : w)
      if (c != ' ') c = static_cast<char>((c >= 'a' ? 'a' : 'A') + ((c - (c >= 'a' ? 'a' : 'A')) + k) % 26);
    return w;
  }(), nullptr);
  f.hint = "implement caesar";
  return f;
}

PyFunction digit_root(Rng& rng) {
  PyFunction f;
  f.name = "digit_root";
  const std::string def =
      "def digit_root(n):\n"
      "    \"\"\"Sums the decimal digits of the non-negative integer n, again and again, until one digit\n"
      "    is left, and returns it: digit_root(9875) == 2 (9+8+7+5 = 29, 2+9 = 11, 1+1 = 2).\"\"\"\n";
  f.given = def + "    raise NotImplementedError(\"digit_root\")\n";
  f.solution = def + "    while n >= 10:\n        n = sum(int(d) for d in str(n))\n    return n\n";
  std::vector<int64_t> ns = {0, 7};
  for (int i = 0; i < 5; ++i) ns.push_back(static_cast<int64_t>(rng.next() % 1000000000000ull));
  for (int64_t n : ns) {
    int64_t r = n;
    while (r >= 10) {
      int64_t s = 0;
      for (int64_t x = r; x > 0; x /= 10) s += x % 10;
      r = s;
    }
    add_case(f, {n}, r, nullptr);
  }
  f.hint = "implement digit_root";
  return f;
}

PyFunction dedupe(Rng& rng) {
  PyFunction f;
  f.name = "dedupe";
  const std::string def =
      "def dedupe(xs):\n"
      "    \"\"\"Returns the items of the list xs without repeats, each at the place of its first\n"
      "    occurrence: dedupe([3, 1, 3, 2, 1]) == [3, 1, 2].\"\"\"\n";
  f.given = def + "    raise NotImplementedError(\"dedupe\")\n";
  f.solution = def +
               "    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
               "            out.append(x)\n    return out\n";
  add_case(f, {json::array()}, json::array(), nullptr);
  for (int i = 0; i < 6; ++i) {
    json xs = json::array(), want = json::array();
    const int n = rng.range(2, 10);
    for (int k = 0; k < n; ++k) {
      const json x = i % 2 ? json(rng.pick(kWords)) : json(rng.range(0, 6));
      xs.push_back(x);
      if (std::find(want.begin(), want.end(), x) == want.end()) want.push_back(x);
    }
    add_case(f, {xs}, want, nullptr);
  }
  f.hint = "implement dedupe";
  return f;
}

PyFunction to_roman(Rng& rng) {
  PyFunction f;
  f.name = "to_roman";
  const std::string def =
      "def to_roman(n):\n"
      "    \"\"\"Returns n (1 <= n <= 3999) in Roman numerals, using the subtractive forms\n"
      "    IV, IX, XL, XC, CD and CM: to_roman(1994) == \"MCMXCIV\".\"\"\"\n";
  f.given = def + "    raise NotImplementedError(\"to_roman\")\n";
  f.solution = def +
               "    parts = [(1000, \"M\"), (900, \"CM\"), (500, \"D\"), (400, \"CD\"), (100, \"C\"), (90, \"XC\"),\n"
               "             (50, \"L\"), (40, \"XL\"), (10, \"X\"), (9, \"IX\"), (5, \"V\"), (4, \"IV\"), (1, \"I\")]\n"
               "    out = \"\"\n    for value, letters in parts:\n        while n >= value:\n            out += letters\n"
               "            n -= value\n    return out\n";
  static const std::pair<int, const char*> kParts[] = {{1000, "M"}, {900, "CM"}, {500, "D"}, {400, "CD"}, {100, "C"},
                                                       {90, "XC"},  {50, "L"},   {40, "XL"}, {10, "X"},   {9, "IX"},
                                                       {5, "V"},    {4, "IV"},   {1, "I"}};
  std::vector<int> ns = {4, 1994};
  for (int i = 0; i < 5; ++i) ns.push_back(rng.range(1, 3999));
  for (const int n : ns) {
    std::string want;
    int left = n;
    for (const auto& [value, letters] : kParts)
      while (left >= value) want += letters, left -= value;
    add_case(f, {n}, want, nullptr);
  }
  f.hint = "implement to_roman";
  return f;
}

const std::vector<std::pair<std::string, std::function<PyFunction(Rng&)>>>& python_bugs() {
  static const std::vector<std::pair<std::string, std::function<PyFunction(Rng&)>>> v = {
      {"sum_between", sum_between}, {"count_word", count_word}, {"clamp", clamp}, {"is_leap", is_leap},
      {"running_max", running_max}, {"chunk", chunk},           {"average", average}};
  return v;
}

const std::vector<std::pair<std::string, std::function<PyFunction(Rng&)>>>& python_stubs() {
  static const std::vector<std::pair<std::string, std::function<PyFunction(Rng&)>>> v = {
      {"run_length", run_length}, {"caesar", caesar}, {"digit_root", digit_root}, {"dedupe", dedupe}, {"to_roman", to_roman}};
  return v;
}

const char* const kCheckHeader =
    "#!/bin/sh\n"
    "# The check for this task: exits 0 exactly when the task is solved. It is restored before\n"
    "# every run, so editing it (or anything under tests/) changes nothing.\n"
    "cd \"$(dirname \"$0\")\" || exit 2\n";

// check.sh for a Python test script whose last line is "passed N of N" on success.
std::string python_check(const std::string& script, size_t cases) {
  const std::string n = std::to_string(cases);
  return std::string(kCheckHeader) + "out=$(python3 " + script + " 2>&1)\nstatus=$?\nprintf '%s\\n' \"$out\"\n" +
         "[ \"$status\" -eq 0 ] || exit 1\n" + "[ \"$(printf '%s\\n' \"$out\" | tail -n 1)\" = \"passed " + n + " of " + n +
         "\" ] || exit 1\n";
}

Project python_project(Rng& rng, bool implement) {
  const auto& table = implement ? python_stubs() : python_bugs();
  const auto& [variant, make] = table[rng.below(static_cast<uint32_t>(table.size()))];
  PyFunction f = make(rng);
  if (!f.given_fails && !implement) throw std::logic_error("files: python_fix variant " + variant + " has no failing case");
  const std::string module = rng.pick(kModules);
  const std::string source = "src/" + module + ".py";
  const std::string test = "tests/test_" + module + ".py";

  Project p;
  p.family = implement ? "python_implement" : "python_fix";
  p.variant = variant;
  p.statement = implement ? "Implement the function `" + f.name + "` in `" + source +
                                "` as its docstring describes, so that `sh check.sh` passes (it runs `" + test + "`)."
                          : "The tests fail: " + f.hint + ". Fix the bug in `" + f.name + "` in `" + source +
                                "` so that `sh check.sh` passes (it runs `" + test + "`).";
  const std::string header = "\"\"\"" + module + ": small helpers.\"\"\"\n\n\n";
  const std::string harness =
      "import json\nimport os\nimport sys\n\n"
      "sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), \"..\", \"src\"))\n"
      "from " + module + " import " + f.name + "  # noqa: E402\n\n"
      "CASES = json.loads(r\"\"\"" + f.cases.dump() + "\"\"\")\n\n"
      "failed = 0\n"
      "for args, want in CASES:\n"
      "    try:\n"
      "        got = " + f.name + "(*args)\n"
      "    except Exception as e:  # a crash fails the case, not the run\n"
      "        got = \"%s: %s\" % (type(e).__name__, e)\n"
      "    if got != want or type(got) is not type(want):\n"
      "        failed += 1\n"
      "        print(\"FAIL " + f.name + "(%s): expected %r, got %r\" % (\", \".join(repr(a) for a in args), want, got))\n"
      "print(\"passed %d of %d\" % (len(CASES) - failed, len(CASES)))\n"
      "sys.exit(1 if failed else 0)\n";
  p.files = {{source, header + f.given}, {test, harness}, {"check.sh", python_check(test, f.cases.size())}};
  p.protected_paths = {"check.sh", test};
  p.solution = {{source, header + f.solution}};
  return p;
}

// ---- shell scripts ---------------------------------------------------------------------------

struct ShellScript {
  std::string name;
  std::string given;
  std::string solution;
  std::vector<std::vector<std::string>> args;  // one list per case
  std::vector<std::string> want;               // expected stdout per case
  bool given_fails = false;
  std::string hint;
  std::vector<ProjectFile> data;  // extra protected files the script reads
};

void shell_case(ShellScript& s, std::vector<std::string> args, const std::string& want, const std::string& given_output) {
  if (want != given_output) s.given_fails = true;
  s.args.push_back(std::move(args));
  s.want.push_back(want);
}

ShellScript sum_to(Rng& rng) {
  ShellScript s;
  s.name = "sum_to";
  const std::string head = "#!/bin/sh\n# Prints the sum 1 + 2 + ... + N of the N given as the first argument (0 when N < 1).\nn=$1\ni=1\ntotal=0\n";
  const std::string tail = "  total=$((total + i))\n  i=$((i + 1))\ndone\necho \"$total\"\n";
  s.given = head + "while [ \"$i\" -lt \"$n\" ]; do\n" + tail;
  s.solution = head + "while [ \"$i\" -le \"$n\" ]; do\n" + tail;
  std::vector<int> ns = {0, 1};
  for (int i = 0; i < 4; ++i) ns.push_back(rng.range(2, 300));
  for (const int n : ns) shell_case(s, {std::to_string(n)}, std::to_string(n * (n + 1) / 2), std::to_string(n < 1 ? 0 : (n - 1) * n / 2));
  s.hint = "sum_to.sh prints wrong sums";
  return s;
}

ShellScript max_of(Rng& rng) {
  ShellScript s;
  s.name = "max";
  const std::string head = "#!/bin/sh\n# Prints the largest of the integers given as arguments.\nmax=$1\nshift\nfor x in \"$@\"; do\n";
  const std::string tail = "    max=$x\n  fi\ndone\necho \"$max\"\n";
  s.given = head + "  if [ \"$x\" -lt \"$max\" ]; then\n" + tail;
  s.solution = head + "  if [ \"$x\" -gt \"$max\" ]; then\n" + tail;
  for (int i = 0; i < 5; ++i) {
    std::vector<std::string> args;
    int hi = -1000, lo = 1000;
    const int n = rng.range(i == 0 ? 1 : 2, 6);
    for (int k = 0; k < n; ++k) {
      const int x = rng.range(-100, 100);
      hi = std::max(hi, x);
      lo = std::min(lo, x);
      args.push_back(std::to_string(x));
    }
    shell_case(s, args, std::to_string(hi), std::to_string(lo));
  }
  shell_case(s, {"3", "9", "4"}, "9", "3");
  s.hint = "max.sh does not print the largest number";
  return s;
}

ShellScript count_matches(Rng& rng) {
  ShellScript s;
  s.name = "count_matches";
  const std::string head = "#!/bin/sh\n# Prints how many lines of the file $2 contain the word $1, ignoring case.\n";
  s.given = head + "grep -c -- \"$1\" \"$2\"\n";
  s.solution = head + "grep -c -i -- \"$1\" \"$2\"\n";
  std::vector<std::string> lines;
  for (int i = 0, n = rng.range(12, 24); i < n; ++i) {
    std::string line;
    for (int w = 0, m = rng.range(2, 6); w < m; ++w) line += (w ? " " : "") + cased(rng, rng.pick(kWords));
    lines.push_back(line);
  }
  std::string text;
  for (const std::string& l : lines) text += l + "\n";
  s.data.push_back({"tests/data/notes.txt", text});
  for (int i = 0; i < 6; ++i) {
    const std::string word = rng.pick(kWords);
    int right = 0, exact = 0;
    for (const std::string& l : lines) {
      right += lower(l).find(word) != std::string::npos;
      exact += l.find(word) != std::string::npos;
    }
    shell_case(s, {word, "tests/data/notes.txt"}, std::to_string(right), std::to_string(exact));
  }
  if (!s.given_fails) {  // make sure one case needs the case-insensitive match
    s.data[0].content += "SALT and Salt\n";
    lines.push_back("SALT and Salt");
    int right = 0;
    for (const std::string& l : lines) right += lower(l).find("salt") != std::string::npos;
    for (size_t c = 0; c < s.args.size(); ++c) {  // earlier cases may count "salt" too
      if (s.args[c][0] == "salt") s.want[c] = std::to_string(right);
    }
    int exact = 0;
    for (const std::string& l : lines) exact += l.find("salt") != std::string::npos;
    shell_case(s, {"salt", "tests/data/notes.txt"}, std::to_string(right), std::to_string(exact));
  }
  s.hint = "count_matches.sh miscounts";
  return s;
}

ShellScript greet(Rng& rng) {
  ShellScript s;
  s.name = "greet";
  const std::vector<std::string> greetings = {"Hello", "Welcome", "Good morning", "Greetings"};
  const std::string g = rng.pick(greetings);
  const std::string head = "#!/bin/sh\n# Prints \"" + g + ", NAME!\" for the NAME given as the first argument, or \"" + g +
                           ", world!\" without one.\n";
  s.given = head + "name=$1\necho \"" + g + ", $name!\"\n";
  s.solution = head + "name=${1:-world}\necho \"" + g + ", $name!\"\n";
  for (int i = 0; i < 3; ++i) {
    const std::string name = cased(rng, rng.pick(kWords));
    shell_case(s, {name}, g + ", " + name + "!", g + ", " + name + "!");
  }
  shell_case(s, {}, g + ", world!", g + ", !");
  s.hint = "greet.sh misbehaves without an argument";
  return s;
}

ShellScript fizz(Rng& rng) {
  ShellScript s;
  s.name = "fizz";
  static const std::pair<int, int> kPairs[] = {{2, 3}, {2, 5}, {3, 5}, {2, 7}, {3, 7}, {5, 7}, {3, 4}};
  const auto [a, b] = kPairs[rng.below(7)];
  const std::string A = std::to_string(a), B = std::to_string(b);
  const std::string head = "#!/bin/sh\n# Prints the numbers 1 to N (the first argument), one per line, but \"fizz\" for multiples of " +
                           A + ",\n# \"buzz\" for multiples of " + B + " and \"fizzbuzz\" for multiples of both.\nn=$1\ni=1\n" +
                           "while [ \"$i\" -le \"$n\" ]; do\n";
  const std::string tail = "  else\n    echo \"$i\"\n  fi\n  i=$((i + 1))\ndone\n";
  const std::string both = "[ $((i % " + std::to_string(a * b) + ")) -eq 0 ]; then\n    echo fizzbuzz\n";
  const std::string fz = "[ $((i % " + A + ")) -eq 0 ]; then\n    echo fizz\n";
  const std::string bz = "[ $((i % " + B + ")) -eq 0 ]; then\n    echo buzz\n";
  s.given = head + "  if " + fz + "  elif " + bz + "  elif " + both + tail;
  s.solution = head + "  if " + both + "  elif " + fz + "  elif " + bz + tail;
  auto run = [&](int n, bool right) {
    std::string out;
    for (int i = 1; i <= n; ++i) {
      std::string line = std::to_string(i);
      if (right && i % (a * b) == 0) line = "fizzbuzz";
      else if (i % a == 0) line = "fizz";
      else if (i % b == 0) line = "buzz";
      out += (i > 1 ? "\n" : "") + line;
    }
    return out;
  };
  std::vector<int> ns = {1, rng.range(a * b, 3 * a * b), rng.range(2, a * b - 1)};
  for (const int n : ns) shell_case(s, {std::to_string(n)}, run(n, true), run(n, false));
  s.hint = "fizz.sh prints some wrong lines";
  return s;
}

Project shell_project(Rng& rng) {
  static const std::vector<std::pair<std::string, std::function<ShellScript(Rng&)>>> table = {
      {"sum_to", sum_to}, {"max", max_of}, {"count_matches", count_matches}, {"greet", greet}, {"fizz", fizz}};
  const auto& [variant, make] = table[rng.below(static_cast<uint32_t>(table.size()))];
  ShellScript s = make(rng);
  if (!s.given_fails) throw std::logic_error("files: shell_fix variant " + variant + " has no failing case");
  const std::string script = "bin/" + s.name + ".sh";
  Project p;
  p.family = "shell_fix";
  p.variant = variant;
  p.statement = "The check fails: " + s.hint + ". Fix the bug in `" + script + "` (a POSIX sh script) so that `sh check.sh` passes.";
  std::string check = std::string(kCheckHeader) +
                      "failed=0\ntotal=0\n"
                      "run() {\n"
                      "  want=$(cat \"tests/expected/$1.txt\")\n"
                      "  shift\n"
                      "  total=$((total + 1))\n"
                      "  got=$(sh " + script + " \"$@\" 2>&1)\n"
                      "  if [ \"$got\" = \"$want\" ]; then\n"
                      "    echo \"ok: " + s.name + ".sh $*\"\n"
                      "  else\n"
                      "    failed=$((failed + 1))\n"
                      "    echo \"FAIL: " + s.name + ".sh $*\"\n"
                      "    echo \"  expected: $want\"\n"
                      "    echo \"  got:      $got\"\n"
                      "  fi\n"
                      "}\n";
  p.files = {{script, s.given}};
  p.protected_paths = {"check.sh"};
  for (size_t c = 0; c < s.args.size(); ++c) {
    const std::string expected = "tests/expected/" + std::to_string(c + 1) + ".txt";
    p.files.push_back({expected, s.want[c] + "\n"});
    p.protected_paths.push_back(expected);
    check += "run " + std::to_string(c + 1);
    for (const std::string& a : s.args[c]) check += " " + quoted(a);
    check += "\n";
  }
  for (const ProjectFile& d : s.data) {
    p.files.push_back(d);
    p.protected_paths.push_back(d.path);
  }
  check += "echo \"passed $((total - failed)) of $total\"\n[ \"$failed\" -eq 0 ]\n";
  p.files.push_back({"check.sh", check});
  p.solution = {{script, s.solution}};
  return p;
}

// ---- config files ----------------------------------------------------------------------------

Project config_project(Rng& rng) {
  const std::string service = rng.pick(kServices);
  const std::vector<std::string> levels = {"debug", "info", "warning", "error"};
  Project p;
  p.family = "config";
  const bool ini = rng.chance(0.5);
  p.variant = ini ? "ini" : "json";
  if (ini) {
    const std::string path = "config/" + service + ".ini";
    // section -> ordered (key, value)
    const std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>> want = {
        {"server",
         {{"host", rng.chance(0.5) ? "0.0.0.0" : "127.0.0.1"},
          {"port", std::to_string(rng.range(1024, 65000))},
          {"workers", std::to_string(rng.range(1, 32))}}},
        {"logging", {{"level", rng.pick(levels)}, {"file", "logs/" + service + ".log"}}},
        {"limits",
         {{"max_connections", std::to_string(rng.range(10, 5000))}, {"timeout_s", std::to_string(rng.range(1, 120))}}}};
    std::string given = "# Settings of the " + service + " service.\n", full = given, spec;
    json expected = json::object();
    int wrong = 0;
    for (const auto& [section, keys] : want) {
      given += "\n[" + section + "]\n";
      full += "\n[" + section + "]\n";
      for (const auto& [key, value] : keys) {
        full += key + " = " + value + "\n";
        spec += "- `[" + section + "] " + key + "` = `" + value + "`\n";
        expected[section][key] = value;
        const uint32_t state = rng.below(3);  // 0 right, 1 TODO, 2 missing
        if (state == 0 && !(wrong < 2 && section == "limits")) given += key + " = " + value + "\n";
        else if (state == 1) given += key + " = TODO\n", ++wrong;
        else ++wrong;
      }
    }
    p.statement = "Complete `" + path + "` (INI: `[section]` headers, `key = value` lines) so that it sets:\n" + spec +
                  "Then `sh check.sh` passes.";
    const std::string checker =
        "import configparser\nimport json\nimport sys\n\n"
        "EXPECTED = json.loads(r\"\"\"" + expected.dump() + "\"\"\")\n"
        "parser = configparser.ConfigParser(interpolation=None)\n"
        "try:\n"
        "    if not parser.read(\"" + path + "\"):\n"
        "        print(\"FAIL: " + path + " is missing\")\n"
        "        sys.exit(1)\n"
        "except configparser.Error as e:\n"
        "    print(\"FAIL: " + path + " does not parse: %s\" % e)\n"
        "    sys.exit(1)\n"
        "total = failed = 0\n"
        "for section, keys in EXPECTED.items():\n"
        "    for key, want in keys.items():\n"
        "        total += 1\n"
        "        got = parser.get(section, key, fallback=None)\n"
        "        if got is None or got.strip() != want:\n"
        "            failed += 1\n"
        "            print(\"FAIL: [%s] %s: expected %r, got %r\" % (section, key, want, got))\n"
        "print(\"passed %d of %d\" % (total - failed, total))\n"
        "sys.exit(1 if failed else 0)\n";
    size_t count = 0;
    for (const auto& [section, keys] : want) count += keys.size();
    p.files = {{path, given}, {"tests/check_config.py", checker}, {"check.sh", python_check("tests/check_config.py", count)}};
    p.solution = {{path, full}};
  } else {
    const std::string path = "config/" + service + ".json";
    static const std::vector<std::string> kFeatures = {"metrics", "tracing", "cache", "compression", "audit", "retries"};
    json features = json::array();
    for (const std::string& f : kFeatures)
      if (rng.chance(0.5)) features.push_back(f);
    if (features.empty()) features.push_back(kFeatures[rng.below(6)]);
    const json expected = {{"service", service},
                           {"server", {{"port", rng.range(1024, 65000)}, {"workers", rng.range(1, 32)}}},
                           {"logging", {{"level", rng.pick(levels)}}},
                           {"features", features},
                           {"retries", rng.range(0, 9)}};
    // Given: the service name and logging right, the rest missing or "TODO".
    json given = {{"service", service}, {"server", {{"port", "TODO"}}}, {"logging", expected["logging"]}};
    if (rng.chance(0.5)) given["retries"] = "TODO";
    std::string spec;
    spec += "- `service`: the string \"" + service + "\"\n";
    spec += "- `server.port`: the number " + expected["server"]["port"].dump() + "\n";
    spec += "- `server.workers`: the number " + expected["server"]["workers"].dump() + "\n";
    spec += "- `logging.level`: the string " + expected["logging"]["level"].dump() + "\n";
    spec += "- `features`: the list " + features.dump() + " (in this order)\n";
    spec += "- `retries`: the number " + expected["retries"].dump() + "\n";
    p.statement = "Complete `" + path + "` (a JSON object; `server.port` means key `port` of the object under `server`) so "
                  "that it holds:\n" + spec + "Numbers must be JSON numbers, not strings. Then `sh check.sh` passes.";
    const std::string checker =
        "import json\nimport sys\n\n"
        "EXPECTED = json.loads(r\"\"\"" + expected.dump() + "\"\"\")\n"
        "try:\n"
        "    with open(\"" + path + "\") as f:\n"
        "        got = json.load(f)\n"
        "except (OSError, ValueError) as e:\n"
        "    print(\"FAIL: " + path + ": %s\" % e)\n"
        "    sys.exit(1)\n"
        "if not isinstance(got, dict):\n"
        "    print(\"FAIL: " + path + " must hold a JSON object\")\n"
        "    sys.exit(1)\n"
        "checks = []\n"
        "for key, want in EXPECTED.items():\n"
        "    if isinstance(want, dict):\n"
        "        inner = got.get(key)\n"
        "        for sub, v in want.items():\n"
        "            checks.append((key + \".\" + sub, v, inner.get(sub) if isinstance(inner, dict) else None))\n"
        "    else:\n"
        "        checks.append((key, want, got.get(key)))\n"
        "failed = 0\n"
        "for name, want, value in checks:\n"
        "    if value != want or type(value) is not type(want):\n"
        "        failed += 1\n"
        "        print(\"FAIL: %s: expected %r, got %r\" % (name, want, value))\n"
        "print(\"passed %d of %d\" % (len(checks) - failed, len(checks)))\n"
        "sys.exit(1 if failed else 0)\n";
    p.files = {{path, given.dump(2) + "\n"}, {"tests/check_config.py", checker}, {"check.sh", python_check("tests/check_config.py", 6)}};
    p.solution = {{path, expected.dump(2) + "\n"}};
  }
  p.protected_paths = {"check.sh", "tests/check_config.py"};
  return p;
}

}  // namespace

const std::vector<std::string>& families() {
  static const std::vector<std::string> names = {"python_fix", "python_implement", "shell_fix", "config"};
  return names;
}

Project make_project(const std::string& family, uint64_t seed) {
  Rng rng(seed);
  std::string chosen = family;
  if (chosen.empty()) chosen = families()[rng.below(static_cast<uint32_t>(families().size()))];
  Project p;
  if (chosen == "python_fix") p = python_project(rng, /*implement=*/false);
  else if (chosen == "python_implement") p = python_project(rng, /*implement=*/true);
  else if (chosen == "shell_fix") p = shell_project(rng);
  else if (chosen == "config") p = config_project(rng);
  else throw std::invalid_argument("unknown family '" + family + "'");
  p.files.insert(p.files.begin(), {"TASK.md", "# Task\n\n" + p.statement + "\n"});
  return p;
}

}  // namespace odyssey::files
