"""Run operations around the research loop of `training/`, none of which changes what a step
computes; `training/loop.py` calls them by name (docs/layout.md lists each module's job).
"""
