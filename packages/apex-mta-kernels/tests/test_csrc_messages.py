"""The reader of ostream-formatted messages in C++/CUDA sources (testing.csrc_messages), on
snippets and on this package's own sources (the feature packages run it on theirs through
package_checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apex.multi_tensor_apply.testing.csrc_messages import findings, findings_in

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize(
    "line",
    [
        'TORCH_CHECK(n > 0, "n is ", n);',
        "TORCH_CHECK_VALUE(ok, message);",
        'TORCH_INTERNAL_ASSERT(a == b, "a ", a);',
        'auto s = c10::str("x", 3);',
        'TORCH_WARN("knob ", k, " ignored");',
        'TORCH_WARN_ONCE("once");',
        "std::ostringstream os;",
        "std::stringstream ss;",
        'std::cerr << "x";',
        'STD_TORCH_CHECK(n > 0, "n must be positive");',  # streams __LINE__
        "TORCH_CHECK_EQ(a, b);",
        "TORCH_DCHECK_LT(a, b);",
        'AT_ERROR("bad n ", n);',
        'AT_ASSERTM(ok, "n ", n);',
        'LOG(WARNING) << "n " << n;',
        "std::ofstream f(path);",
        "std::wostringstream os;",
        "using namespace std;",
        "using c10::str;",
        "#define CHECK_ TORCH_CHECK",
        # a digit separator is no character literal: what follows it is still read
        'TORCH_CHECK(n <= 1\'024, "n is ", n);',
        'int k = 1\'000; TORCH_WARN("n=", n);',
        "int k = 1'8'000; TORCH_WARN(\"n=\", n);",
        # as layer_norm.cu built APEX_NORM_TUNE's notes until 2026-12-05 (the crash)
        'auto note = [&](auto&&... parts) { r.notes += c10::str("APEX_NORM_TUNE: ", parts...); };',
    ],
)
def test_ostream_formatting_is_found(line):
    text = f"int f(int n) {{\n  // a comment\n  {line}\n}}\n"
    found = findings_in(text, "x.cu")
    assert len(found) == 1, found
    assert found[0].startswith("x.cu:3: ")


@pytest.mark.parametrize(
    "line",
    [
        'TORCH_CHECK(n > 0, "n must be positive");',
        'TORCH_CHECK(n > 0, "adjacent " "literals");',
        "TORCH_INTERNAL_ASSERT(a == b);",
        'TORCH_CHECK_VALUE(ok, ::apex_mta::fmt("n is ", n));',
        "#define APEX_CHECK(cond, ...) TORCH_CHECK(cond, ::apex_mta::fmt(__VA_ARGS__))",
        'TORCH_CHECK(g("(", h(1, 2)), "a ) and a , in the message");',
        '// c10::str("in a comment", 1); TORCH_WARN("too");',
        '/* TORCH_CHECK(x, "a", 1); */ const char* s = "c10::str( std::cout";',
        "char q = '\\'', r = '(';",
        'std::string s = fmt("n=", n);',
        'TORCH_CHECK_WITH(ValueError, n > 0, "n must be positive");',
        'TORCH_CHECK_WITH(ValueError, n > 0, fmt("n is ", n));',
        'const char* s = R"(use "std::cout" and TORCH_WARN("x", 1) here)";',
        'const char* s = R"x(a )" c10::str( inside)x";',
        "char a = u'x', b = L'(', c = u8'y';",
    ],
)
def test_what_builds_no_ostream_message_is_left_alone(line):
    assert findings_in(f"void f() {{\n  {line}\n}}\n", "x.cu") == []


def test_a_message_over_lines_is_read_whole():
    text = 'TORCH_CHECK(ok,\n            "first line "\n            "second line");\n'
    assert findings_in(text) == []
    assert findings_in(text.replace('"second line"', '"second ", n')) == [
        "<text>:1: TORCH_CHECK message formatted by c10::str"
    ]


def test_lines_are_counted_past_an_unclosed_literal_and_a_raw_string():
    text = 'const char* s = "unclosed\nconst char* r = R"(\n)";\nTORCH_WARN("n=", n);\n'
    assert findings_in(text) == ["<text>:4: TORCH_WARN"]


def test_a_call_left_open_is_not_read_to_the_end_of_the_file():
    text = "TORCH_CHECK(f(a;\n" + "int x = g(1, 2);\n" * 3 + 'TORCH_CHECK(ok, "n ", n);\n'
    assert findings_in(text) == ["<text>:5: TORCH_CHECK message formatted by c10::str"]


def test_folders_and_broken_links_named_like_sources_are_not_read(tmp_path):
    (tmp_path / "dir.cu").mkdir()
    (tmp_path / "gone.h").symlink_to(tmp_path / "nowhere.h")
    (tmp_path / "ok.cu").write_text('TORCH_WARN("x ", 1);\n')
    assert findings(tmp_path) == [f"{tmp_path / 'ok.cu'}:1: TORCH_WARN"]


def test_this_packages_sources_format_no_message_through_an_ostream():
    assert list(SRC.rglob("*.cu")), "no CUDA sources found: the check would read nothing"
    assert findings(SRC) == []
