"""Every option of every command can also come from the environment, as
``REPACK_<COMMAND>_<OPTION>`` (``--shard-size`` of ``repack images``: ``REPACK_IMAGES_SHARD_SIZE``;
a flag takes 1/true/yes or 0/false/no), shown in ``--help``. This is how Kubernetes Jobs and
Slurm scripts pass settings; an option given on the command line wins."""

from __future__ import annotations

import click

PREFIX = "REPACK"


def envvar_name(command: str, option: click.Option) -> str:
    """``REPACK_<COMMAND>_<OPTION>`` from the command name and the option's first long flag."""
    flag = next(o for o in option.opts if o.startswith("--"))
    return f"{PREFIX}_{command}_{flag[2:]}".upper().replace("-", "_")


def bind_envvars(group: click.Group) -> dict[str, str]:
    """Give every option of the group's commands its environment variable (listed in --help);
    returns {variable: command}. Options that set a variable already keep it."""
    names: dict[str, str] = {}
    for name, command in group.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or not param.expose_value:  # --help
                continue
            if param.envvar is None:
                param.envvar = envvar_name(name, param)
            param.show_envvar = True
            if param.envvar in names:
                raise ValueError(f"{param.envvar} names options of both {names[param.envvar]} and {name}")
            names[param.envvar] = name
    return names
