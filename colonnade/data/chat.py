"""Chat records as text: Colonnade's built-in chat format, or the tokenizer's own chat template.

A chat record (``colonnade prepare --data.format=sft``, :mod:`colonnade.data.sft`) is
``{"messages": [{"role": str, "content": str}, ...]}`` with at least one "assistant" message.
Its text is a list of segments ``(text, trained)``, joined in order; the tokens of a segment
with ``trained`` True are the ones the loss counts. Two renderings:

* **Built-in** (the tokenizer has no chat template, e.g. the BPE that ``prepare`` trains): each
  message is ``"<role>: <content>\\n"``; only each assistant message's ``"<content>\\n"`` is
  trained on (not its ``"assistant: "`` header). For example::

      [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
       {"role": "assistant", "content": "hey"}]
      -> "system: be brief\\nuser: hi\\nassistant: hey\\n"   (trained: "hey\\n")

  To generate a reply, prompt with the conversation so far followed by ``"assistant: "``.
  :data:`BUILTIN_CHAT_TEMPLATE` is this format as a Jinja chat template, which the HF export
  writes when the tokenizer had none, so that transformers'
  ``apply_chat_template(messages, tokenize=False)`` returns exactly this text (and with
  ``add_generation_prompt=True`` ends in ``"assistant: "``).
* **The tokenizer's chat template**: when the tokenizer directory (``data.tokenizer``; for a
  tokenizer.json file, its folder) holds a ``chat_template`` in ``tokenizer_config.json`` or a
  ``chat_template.jinja`` file, transformers renders the messages
  (``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False)``) and the
  text trained on is exactly that render. Trained segments: for each assistant message ``i``,
  the text that the render of ``messages[:i + 1]`` adds to the render of ``messages[:i]`` with
  ``add_generation_prompt=True``: the reply and the template's end-of-turn text (in ChatML
  ``"hey<|im_end|>\\n"``). Each of those renders must be a prefix of the whole render; a
  record for which the template does otherwise (e.g. it rewrites earlier turns) is refused as a
  bad record, naming the message. Rendering needs the ``transformers`` package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from colonnade.data.errors import DataError

Segment = tuple[str, bool]
"""A piece of an example's text and whether its tokens are trained on."""

Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The file transformers (>= 4.50) saves a tokenizer's chat template in; it takes precedence
over ``tokenizer_config.json``'s ``chat_template``."""

BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""The built-in format (``"<role>: <content>\\n"`` per message) as a Jinja chat template for
transformers; ``add_generation_prompt`` appends ``"assistant: "``."""


def check_messages(messages: Any) -> list[Message] | str:
    """``messages`` as a list of role/content dicts, or why it cannot be trained on."""
    if not isinstance(messages, list):
        return "'messages' is not a list"
    out: list[Message] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(role, str) or not isinstance(content, str):
            return f"messages[{i}] needs string 'role' and 'content'"
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        return "no assistant message to train on"
    return out


def builtin_segments(messages: Sequence[Message]) -> list[Segment]:
    """The built-in format's segments: ``"<role>: "`` untrained, then ``"<content>\\n"``,
    trained for assistant messages."""
    out: list[Segment] = []
    for m in messages:
        out += [(f"{m['role']}: ", False), (m["content"] + "\n", m["role"] == "assistant")]
    return out


class ChatTemplate:
    """A tokenizer's own chat template, rendered by transformers (see the module docstring).

    ``directory``: the tokenizer folder. ``template``: the Jinja text used (the default one when
    the tokenizer names several), which ``prepare`` stores with the data so that the HF export
    writes the same template.
    """

    def __init__(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise DataError(f"{directory} has a chat template; applying it to chat records "
                            "needs transformers: pip install transformers") from err
        self.directory = directory
        try:
            self._tok = AutoTokenizer.from_pretrained(str(directory))
            self.template: str = self._tok.get_chat_template()
        except (OSError, ValueError) as err:
            raise DataError(f"{directory}: transformers cannot load its tokenizer or chat "
                            f"template ({err}); fix the tokenizer folder") from err

    def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> str:
        """``apply_chat_template(messages, tokenize=False)`` with this template."""
        text = self._tok.apply_chat_template(list(messages), chat_template=self.template,
                                             tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return str(text)

    def segments(self, messages: Sequence[Message]) -> list[Segment] | str:
        """The render of ``messages`` cut into untrained text and trained assistant replies,
        or why it cannot be (the template raised, or does not render prefixes as prefixes)."""
        from jinja2 import TemplateError

        try:
            full = self.render(messages)
            out: list[Segment] = []
            done = 0
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self.render(messages[:i], generation_prompt=True)
                through = self.render(messages[:i + 1])
                if not (full.startswith(through) and through.startswith(before)
                        and len(before) >= done):
                    return (f"the chat template of {self.directory} does not render messages"
                            f"[:{i + 1}] as the start of the whole conversation, so the reply "
                            f"of messages[{i}] cannot be located for the loss mask")
                start = len(before)
                out += [(full[done:start], False), (full[start:len(through)], True)]
                done = len(through)
        except (TemplateError, TypeError, ValueError, KeyError) as err:
            return f"the chat template of {self.directory} fails on it: {err}"
        out.append((full[done:], False))
        if not any(trained for text, trained in out if text):
            return f"the chat template of {self.directory} renders no assistant reply text"
        return [(text, trained) for text, trained in out if text]


def find_chat_template(tokenizer_path: Path | None) -> ChatTemplate | None:
    """The chat template of the tokenizer at ``tokenizer_path`` (a folder, or a tokenizer.json
    whose folder is read), or None: no tokenizer given, or it has no template (the built-in
    format is then used). Only a tokenizer with a template loads transformers."""
    config = tokenizer_config(tokenizer_path)
    if config is None or "chat_template" not in config or tokenizer_path is None:
        return None
    directory = Path(tokenizer_path)
    return ChatTemplate(directory if directory.is_dir() else directory.parent)


def tokenizer_config(tokenizer_path: Path | None, template: str | None = None
                     ) -> dict[str, Any] | None:
    """The ``tokenizer_config.json`` that ``prepare`` keeps beside the tokenizer.json it writes,
    so that checkpoints and the HF export carry the tokenizer's special tokens and chat
    template: the given tokenizer folder's (for a tokenizer.json file, its folder's), its
    ``chat_template.jinja`` as ``chat_template``; ``template`` (the one applied to SFT chat
    records) replaces that. None: nothing to keep (no tokenizer given, or it has neither file).
    Read before any work, so a broken file fails first."""
    config: dict[str, Any] = {}
    source = None if tokenizer_path is None else Path(tokenizer_path)
    if source is not None:
        source = source if source.is_dir() else source.parent
        path = source / "tokenizer_config.json"
        try:
            if path.is_file():
                config = json.loads(path.read_text(encoding="utf-8"))
            if (source / CHAT_TEMPLATE_FILE).is_file():
                config["chat_template"] = (source / CHAT_TEMPLATE_FILE).read_text(
                    encoding="utf-8")
        except (ValueError, OSError, TypeError) as err:
            raise DataError(f"{source}: its tokenizer_config.json / {CHAT_TEMPLATE_FILE} "
                            f"cannot be read ({err}); fix them, or give the tokenizer.json "
                            "in a folder of its own") from err
    if template is not None:
        config["chat_template"] = template
    return config or None


def config_damage(out_dir: Path, config: dict[str, Any] | None) -> str:
    """'' when ``out_dir``/tokenizer_config.json holds ``config`` (from :func:`tokenizer_config`;
    for None: is absent), else what is wrong."""
    path = out_dir / "tokenizer_config.json"
    try:
        held = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (ValueError, OSError):
        held = "unreadable"
    return "" if held == config else f"its {path.name} is not the tokenizer's"


def write_tokenizer_config(out_dir: Path, config: dict[str, Any] | None) -> None:
    """Write ``config`` (from :func:`tokenizer_config`) as ``out_dir``/tokenizer_config.json,
    atomically; None removes one that an earlier prepare of ``out_dir`` left (it belonged to
    another tokenizer)."""
    dest = out_dir / "tokenizer_config.json"
    if config is None:
        dest.unlink(missing_ok=True)
        return
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, dest)
