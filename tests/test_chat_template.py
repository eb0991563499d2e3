"""Where a checkpoint's chat template is found, and what serve says when there is none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_edge.checkpoints.chat_template import chat_template_source, missing_template_note

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
IN_CONFIG = json.dumps({"chat_template": TEMPLATE})


@pytest.mark.parametrize(
    ("files", "found"),
    [
        ({"chat_template.jinja": TEMPLATE}, "chat_template.jinja"),
        ({"chat_template.json": json.dumps({"chat_template": TEMPLATE})}, "chat_template.json"),
        ({"tokenizer_config.json": IN_CONFIG}, "tokenizer_config.json"),
        ({"tokenizer_config.json": IN_CONFIG, "chat_template.jinja": TEMPLATE}, "chat_template.jinja"),
        ({"tokenizer_config.json": json.dumps({"bos_token": "<s>"})}, None),
        ({"tokenizer_config.json": "{not json"}, None),
        ({}, None),
    ],
)
def test_the_template_is_found_where_transformers_reads_it(
    files: dict[str, str], found: str | None, tmp_path: Path
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert chat_template_source(tmp_path) == found


def test_serve_says_chat_will_be_refused_only_without_a_template_of_either_kind(tmp_path: Path) -> None:
    note = missing_template_note(tmp_path, ())
    assert note and "/v1/chat/completions will answer 400" in note and "--chat-template" in note
    assert missing_template_note(tmp_path, ("--chat-template", "t.jinja")) is None
    assert missing_template_note(tmp_path, ("--chat-template=t.jinja",)) is None
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert missing_template_note(tmp_path, ()) is None
