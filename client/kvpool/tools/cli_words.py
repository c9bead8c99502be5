"""The one translation of an error from the daemon's words into the command line's: each wire
field name becomes the flag (or the positional) the user typed for it.

The daemon and the Python API name their inputs by wire field (``budget_bytes``,
``hf_config_json``, ``vllm.kv_cache_memory_bytes``); a ``kvpool`` or ``kvpoold`` command sets
them through flags that read differently (``--budget``, ``--hf-config``). :func:`user_words`
rewrites an error's message for one parsed command: the field's own prefix (``budget_bytes:``)
goes, every wire name of an argument of this command in the text becomes that argument's flag,
and the message is prefixed with the flag only when the user typed it (an error about a flag
they never gave names it in the text: "give --budget ..."). A positional (the pool name) is
never prefixed: the message names it ("pool 'llama' exists ...").
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence

from kvpool.contract.errors import KVPoolError

# Wire fields whose command-line argument has another name: field -> the destinations
# (argparse ``dest``) that set it, preferred first; the first one the user typed wins
# (``kvpool configure --engine vllm --budget 1GiB``: kv_cache_memory_bytes is --budget).
WIRE_TO_DEST: dict[str, tuple[str, ...]] = {
    "budget_bytes": ("budget",),
    "hf_config_json": ("hf_config", "model_config"),
    "hf_config": ("hf_config", "model_config"),
    "model_config": ("hf_config", "model_config", "spec"),
    "spec": ("spec", "model_config"),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", "budget"),
    "name": ("pool",),
}
# Flags that set one value (``kvpool configure --engine vllm``: --budget is vLLM's
# --kv-cache-memory-bytes): a message naming one names the one the user typed.
SAME_VALUE: tuple[tuple[str, str], ...] = (("kv_cache_memory_bytes", "budget"),)
# Sub-message prefixes naming where a field sits on the wire (``vllm.block_size``).
WIRE_PARENTS = ("vllm.",)
# msgspec's location suffix on a top-level field (`` - at `$.page_size` ``).
_AT_FIELD = re.compile(r" - at `\$\.([a-z_]+)`")


class CommandWords:
    """The arguments of one parsed command: which flag sets each destination, which of them
    the user typed.

    Args:
        parser: the subcommand's parser (not the top level's).
        argv: the tokens the user typed (for the subcommand and its arguments).
    """

    def __init__(self, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
        self.flags: dict[str, str] = {}
        self.positionals: set[str] = set()
        typed_options: set[str] = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
        self.typed: set[str] = set()
        for action in parser._actions:
            if action.dest in (argparse.SUPPRESS, "help"):
                continue
            if not action.option_strings:
                self.positionals.add(action.dest)
                self.typed.add(action.dest)  # argparse requires each of them
                continue
            long = [s for s in action.option_strings if s.startswith("--")]
            self.flags[action.dest] = (long or action.option_strings)[0]
            if typed_options & set(action.option_strings):
                self.typed.add(action.dest)

    def dest_of(self, field: str) -> str | None:
        """The destination of this command that sets wire ``field``, or None."""
        for parent in WIRE_PARENTS:
            field = field.removeprefix(parent)
        candidates = WIRE_TO_DEST.get(field, (field,))
        present = [d for d in candidates if d in self.flags or d in self.positionals]
        typed = [d for d in present if d in self.typed]
        return (typed or present or [None])[0]

    def wire_names(self) -> Iterable[tuple[str, str]]:
        """(wire name, flag) for every flag of this command whose wire name differs from it
        spelled with underscores: the words to replace in a message."""
        for dest, flag in self.flags.items():
            yield dest, flag
        for field, dests in WIRE_TO_DEST.items():
            dest = self.dest_of(field)
            if dest in self.flags and dest in dests:
                yield field, self.flags[dest]


def _strip_field_prefixes(message: str, fields: set[str]) -> str:
    """``budget_bytes: give ...`` -> ``give ...``; nested ones too (``model_config:
    hf_config_json: ...``)."""
    while True:
        head, sep, rest = message.partition(": ")
        if not sep or head not in fields:
            return message
        message = rest


def user_words(exc: KVPoolError, words: CommandWords) -> str:
    """``exc``'s message in the words of the command line that ``words`` describes.

    Args:
        exc: the error (from the daemon, the client or the command itself).
        words: the command's arguments and what the user typed.

    Returns:
        The message: wire field names of this command's arguments replaced by their flags,
        prefixed with ``--flag:`` when the field is a flag the user typed.
    """
    names = dict(words.wire_names())
    dest = words.dest_of(exc.field) if exc.field else None
    fields = set(names) | set(WIRE_TO_DEST) | {exc.field or ""}
    fields |= {p + f for p in WIRE_PARENTS for f in fields}
    text = _strip_field_prefixes(exc.message, fields)
    if exc.field and dest is None and text == exc.message and not text.startswith(exc.field):
        text = f"{exc.field}: {text}"  # a field this command has no argument for: as it is
    # msgspec's "- at `$.page_size`" says again which field; the flag prefix says it now.
    text = _AT_FIELD.sub(lambda m: "" if m[1] in names else m[0], text)
    for name in sorted(names, key=len, reverse=True):
        if "_" not in name:
            continue  # plain words ("pool", "spec") stay prose
        text = re.sub(rf"(?<![\w./$`-]){re.escape(name)}(?![\w])", names[name], text)
    for a, b in SAME_VALUE:
        if a in words.flags and b in words.flags:
            for typed, other in ((a, b), (b, a)):
                if typed in words.typed and other not in words.typed:
                    text = re.sub(rf"{re.escape(words.flags[other])}(?![\w-])",
                                  words.flags[typed], text)
    if dest in words.flags and dest in words.typed:
        flag = words.flags[dest]
        if not text.startswith(flag):
            text = f"{flag}: {text}"
    return text
