"""The generated reference pages match the code: a spec field or CLI option added without
regenerating docs/reference/ fails here, with the command that fixes it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "docs" / "gen_reference.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("dtrain_docs_gen_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["spec.md", "cli.md"])
def test_generated_reference_page_is_up_to_date(gen, page):
    path = REPO / "docs" / "reference" / page
    render = {"spec.md": gen.render_spec_reference, "cli.md": gen.render_cli_reference}[page]
    assert path.exists(), f"docs/reference/{page} is missing; run: {gen.REGENERATE}"
    assert path.read_text(encoding="utf-8") == render(), (
        f"docs/reference/{page} is out of date with the code; run: {gen.REGENERATE}")


def _schema_fields(model: dict, defs: dict, prefix: str = "") -> list[str]:
    fields = []
    for name, prop in model.get("properties", {}).items():
        fields.append(prefix + name)
        if "$ref" in prop:
            sub = defs[prop["$ref"].rsplit("/", 1)[-1]]
            fields += _schema_fields(sub, defs, f"{prefix}{name}.")
    return fields


def test_spec_reference_lists_every_field_with_its_description(gen):
    from dtrain.spec.model import JobSpec

    schema = JobSpec.model_json_schema()
    page = gen.render_spec_reference()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.]+)` \|.*$", page,
                                                               re.MULTILINE)}
    fields = _schema_fields(schema, schema["$defs"])
    assert len(fields) > 40
    for field in fields:
        assert field in rows, f"{field} is missing from the spec reference"
    description = JobSpec.model_fields["entry_point"].description.split("`")[0]
    assert description in rows["entry_point"] and "**required**" in rows["entry_point"]
    assert "`100`" in rows["compute.volume_size_gb"], "defaults are shown"


def test_cli_reference_documents_every_command_and_option(gen):
    from dtrain.cli.main import cli

    page = gen.render_cli_reference()

    def walk(command: click.Command, path: str):
        yield command, path
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                if not sub.hidden:
                    yield from walk(sub, f"{path} {name}")

    for command, path in walk(cli, "dtrain"):
        assert f"`{path}`" in page, f"{path} is missing from the CLI reference"
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[-1] in page, f"{path} {param.opts[-1]} is not documented"


def test_check_mode_reports_a_stale_page_with_the_command_to_regenerate(gen, tmp_path,
                                                                         monkeypatch, capsys):
    stale = tmp_path / "spec.md"
    stale.write_text("old\n")
    monkeypatch.setattr(gen, "PAGES", {stale: gen.render_spec_reference})
    assert gen.main(["--check"]) == 1
    assert f"{stale} is out of date; run: python docs/gen_reference.py" in capsys.readouterr().out
    assert stale.read_text() == "old\n", "--check writes nothing"
