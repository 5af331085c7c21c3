"""What happens to a dataset after it is packed: versions and their publishing (``publish``), ``--append``
(``append``, with the record of what a dataset holds in ``input_record``), ``repack remove`` (``remove`` and
one rewrite module per format: ``remove_tar``, ``remove_lmdb``, ``remove_tokens``), ``repack gc``,
``repack pull`` and ``repack verify`` (with the files other tools add, ``foreign``). The jobs that pack a
dataset in the first place live in ``repack.jobs``."""
