"""Griffe extension for the docs build: turns the reST bits of our docstrings into Markdown.

The docstrings are Google style but cross-reference in reST (``:class:`Checkpoint```,
``:func:`~taskpoint_hf.restore_last_checkpoint```) and introduce examples with ``text::``.
mkdocstrings renders Markdown, so without this the roles show up literally. Each role
becomes an *optional* autorefs link: a link where the target is on the site, plain code
where it is not (a private helper, the standard library), so ``--strict`` never fails on
one. A relative name is looked up from the innermost scope outwards (class, module,
package), as Sphinx does. ``text::`` before an indented example becomes ``text:``.

Loaded from ``mkdocs.yml`` (``extensions:`` of the Python handler); not part of any package.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(~?)([^`]+)`")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::(?=\n[ \t]*\n)")


def _exists(loader: griffe.GriffeLoader, path: str) -> bool:
    """Return whether ``path`` names an object griffe has loaded (aliases resolved)."""
    try:
        loader.modules_collection[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _identifier(target: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """Return the full dotted path ``target`` refers to from ``obj``'s docstring.

    Args:
        target: The role's target as written, without ``~``.
        obj: The object whose docstring holds the role.
        loader: The loader that holds every loaded package.

    Returns:
        The first of ``<scope>.<target>`` that exists, scopes from ``obj`` outwards, then
        ``target`` itself; ``target`` when none exists (the link is optional).
    """
    scope: griffe.Object | None = obj
    while scope is not None:
        candidate = f"{scope.path}.{target}"
        if _exists(loader, candidate):
            return candidate
        scope = scope.parent
    return target


def _rewrite(text: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """Return ``text`` with reST roles as optional autorefs and ``::`` as ``:``."""

    def link(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        ident = _identifier(target, obj, loader)
        return (
            f'<autoref identifier="{html.escape(ident)}" optional>'
            f"<code>{html.escape(shown)}</code></autoref>"
        )

    return _LITERAL_BLOCK.sub(":", _ROLE.sub(link, text))


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    """Return ``obj`` and every object defined inside it (aliases to elsewhere skipped)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, griffe.Object):
            found.extend(_walk(member))
    return found


class ReSTToMarkdown(griffe.Extension):
    """Rewrite each docstring of a loaded package once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg`` and everything in it.

        Args:
            pkg: The package griffe has just finished loading.
            loader: The loader, for looking names up.
            **kwargs: Other hook arguments (unused).
        """
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj.docstring.value, obj, loader)
