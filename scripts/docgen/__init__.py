"""Generators of the docs site's reference pages (run by mkdocs_hook.py at every build).

fields.py reads option dataclasses' field docs; config_ref.py, logic_ref.py, api_ref.py and
cli_ref.py render the topology/options, step-logic, Python API and CLI references from the
code; pages.py lists the generated pages and the problems that fail a strict build.
"""
