"""The example notebooks, shipped inside the package as ``rtnb.notebooks``
(``rtnb demo`` runs quickstart.ipynb from here, also from a non-editable install)."""
