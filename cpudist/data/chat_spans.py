"""A conversation's prefix renders from one render of the whole, where the chat template allows it.

Finding each answer's character span takes the render of every prompt and prompt + answer
(tokenize.py: `_tokenize_conversation`); that is 2 renders per answer and, at a million rows, half
of the tokenizing time. Most templates (ChatML ones such as SmolLM2's) write the conversation as a
fixed head, one piece per message that depends only on that message and the earlier ones, and a
tail that depends only on `add_generation_prompt`. For those, the render of messages[:k] is the
whole render's first k pieces plus the tail, so one render with a marker after each piece gives
them all.

Which templates qualify is decided once per template from its Jinja syntax tree, conservatively:
one top-level `{% for message in messages %}`; before and inside it `messages` only as
`messages[0]`, `loop` only as loop.first / index / index0 / previtem / cycle, no
`add_generation_prompt`, no clock, no break / continue / include; after it nothing that the
messages could have set. A template that writes an earlier turn differently once a later one
follows (Qwen3 drops earlier reasoning: it reads `loop.last` and scans `messages`) fails this, and
its rows are rendered prefix by prefix as before. The marked template is checked to parse to
exactly the original tree plus the marker, and each row's render to hold exactly one marker per
message; otherwise the row is rendered the exact way. Jinja has no unparser (hence the marker is
put into the source text and the result checked, not built from the tree).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Private-use code points: no tokenizer's template writes them, and a row whose own text holds
# them has more markers than messages and is rendered the exact way.
MARK = "\ue000\ue001"
_LOOP_ATTRS = {"first", "index", "index0", "previtem", "cycle"}
_VARYING = {"messages", "loop", "add_generation_prompt", "strftime_now"}
_TAG = re.compile(r"\{%([-+]?)\s*(for|endfor)\b")

Render = Callable[[int, bool], str]


@dataclass
class _Plan:
    """A qualifying template: its marked source, and its tail with the generation prompt (a
    constant of the template, learnt from the first row rendered)."""

    source: str
    generation_tail: str | None = field(default=None)


_PLANS: dict[str, _Plan | None] = {}


def derived_renders(tokenizer: Any, messages: list[dict[str, Any]], upto: int) -> Render | None:
    """render(k, generation_prompt), equal to the chat template's render of messages[:k] for
    1 <= k <= upto, from one render of messages[:upto]; None where that cannot be shown (the
    caller then renders each prefix)."""
    plan = template_plan(tokenizer)
    if plan is None or upto < 1:
        return None
    pieces = _marked_pieces(tokenizer, messages[:upto], plan.source, False)
    if pieces is None:
        return None
    if plan.generation_tail is None:
        with_prompt = _marked_pieces(tokenizer, messages[:upto], plan.source, True)
        if with_prompt is None or with_prompt[:-1] != pieces[:-1]:
            return None
        plan.generation_tail = with_prompt[-1]
    whole = "".join(pieces[:-1])
    ends = [0]
    for piece in pieces[:-1]:
        ends.append(ends[-1] + len(piece))
    tails = (pieces[-1], plan.generation_tail)

    def render(k: int, generation_prompt: bool) -> str:
        if not 1 <= k <= upto:
            raise IndexError(k)
        return whole[:ends[k]] + tails[generation_prompt]
    return render


def _marked_pieces(tokenizer: Any, messages: list[dict[str, Any]], source: str,
                   generation_prompt: bool) -> list[str] | None:
    """The marked render split at the markers: one piece per message (the head in the first),
    then the tail; None where the template refuses the row (the exact way says why) or the
    markers are not one per message."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError:
        return None
    pieces = text.split(MARK)
    return pieces if len(pieces) == len(messages) + 1 else None


def template_plan(tokenizer: Any) -> _Plan | None:
    """The tokenizer's chat template's plan, decided once per template; None: not shown to
    qualify."""
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        return None
    if template not in _PLANS:
        _PLANS[template] = _plan(template)
    return _PLANS[template]


def _plan(template: str) -> _Plan | None:
    try:
        from jinja2 import TemplateSyntaxError, nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
        tree = environment.parse(template)
    except Exception:  # noqa: BLE001 - any failure here only means: render the exact way
        return None
    loops = [index for index, node in enumerate(tree.body) if _is_message_loop(node)]
    if len(loops) != 1:
        return None
    loop: nodes.For = tree.body[loops[0]]
    before, after = tree.body[:loops[0]], tree.body[loops[0] + 1:]
    if not _steady(before + loop.body) or not _constant_tail(after, tree):
        return None
    ordinal = next(number for number, node in enumerate(tree.find_all(nodes.For)) if node is loop)
    source = _insert_marker(template, ordinal)
    if source is None:
        return None
    try:
        marked = environment.parse(source)
        expected = environment.parse("{% if true %}{{ '" + MARK + "' }}{% endif %}").body[0]
    except TemplateSyntaxError:
        return None
    marked_loop = list(marked.find_all(nodes.For))[ordinal]
    if not marked_loop.body or marked_loop.body[-1] != expected:
        return None
    marked_loop.body.pop()
    return _Plan(source) if marked == tree else None


def _is_message_loop(node: Any) -> bool:
    from jinja2 import nodes

    return (isinstance(node, nodes.For) and isinstance(node.iter, nodes.Name)
            and node.iter.name == "messages" and not node.else_ and node.test is None
            and not node.recursive)


def _walk(node: Any, parent: Any = None) -> Iterator[tuple[Any, Any]]:
    """Every node under node (itself included) with its parent."""
    from jinja2 import nodes

    yield node, parent
    for child in node.iter_child_nodes():
        if isinstance(child, nodes.Node):
            yield from _walk(child, node)


def _steady(parts: list[Any]) -> bool:
    """Whether parts read nothing that differs between the renders of a conversation's prefixes
    (given at least one message): messages only as messages[0], loop only as its attributes that
    an iteration's place from the start fixes, nor break out of the loop."""
    from jinja2 import nodes

    for part in parts:
        for node, parent in _walk(part):
            if isinstance(node, (nodes.Break, nodes.Continue, nodes.Include, nodes.Import,
                                 nodes.FromImport, nodes.Extends, nodes.Block)):
                return False
            if not isinstance(node, nodes.Name) or node.name not in _VARYING:
                continue
            if node.ctx != "load":
                return False
            if node.name == "messages" and isinstance(parent, nodes.Getitem) \
                    and parent.node is node and isinstance(parent.arg, nodes.Const) \
                    and parent.arg.value == 0:
                continue
            if node.name == "loop" and isinstance(parent, nodes.Getattr) \
                    and parent.attr in _LOOP_ATTRS:
                continue
            return False
    return True


def _constant_tail(parts: list[Any], tree: Any) -> bool:
    """Whether parts (what follows the message loop) read only add_generation_prompt and the
    render's constants (special tokens), nothing the template sets while it writes messages."""
    from jinja2 import nodes

    assigned = {node.name for node in tree.find_all(nodes.Name) if node.ctx != "load"}
    assigned |= {node.name for node in tree.find_all(nodes.Macro)}
    for part in parts:
        for node, _ in _walk(part):
            if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
                return False
            if isinstance(node, nodes.Name) and node.name != "add_generation_prompt" \
                    and (node.name in _VARYING or node.name in assigned):
                return False
    return True


def _insert_marker(template: str, ordinal: int) -> str | None:
    """template with the marker written at the end of the body of its ordinal-th for loop (in
    source order), as a block tag carrying the strip sign of that loop's endfor tag; None where the
    tags cannot be matched (the caller's tree comparison is the check)."""
    tags = list(_TAG.finditer(template))
    starts = [number for number, tag in enumerate(tags) if tag.group(2) == "for"]
    if ordinal >= len(starts):
        return None
    depth = 0
    for tag in tags[starts[ordinal]:]:
        depth += 1 if tag.group(2) == "for" else -1
        if depth == 0:
            at, sign = tag.start(), tag.group(1)
            return (template[:at] + "{%" + sign + " if true %}{{ '" + MARK + "' }}{% endif %}"
                    + template[at:])
    return None
