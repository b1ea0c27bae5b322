"""mkdocs hook: concur's docstrings use Sphinx roles (:func:`x`); show them as plain code."""

import re

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
