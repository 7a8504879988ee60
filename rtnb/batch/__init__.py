"""Unattended runs: the papermill runner (``rtnb run``/``demo``), Ray Jobs
(``rtnb submit``/``jobs``/``logs``) and the ``rtnb`` command line.

Never imports ``rtnb.driver`` or ``rtnb.worker``: a batch run drives a kernel, and
the kernel's notebook starts the session.
"""
