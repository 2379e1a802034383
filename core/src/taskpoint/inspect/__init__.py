"""The inspect layer: what a checkpoint root holds, read back and drawn for people.

- :mod:`taskpoint.inspect.inventory`: the tasks, runs, attempts and checkpoints under a
  root, and their damage;
- :mod:`taskpoint.inspect.timeline`: an action's history in time order, as text or JSON.

The ``taskpoint`` command (:mod:`taskpoint.cli`) shows what these read. It is the top
layer: nothing in taskpoint imports it but the command.
"""
