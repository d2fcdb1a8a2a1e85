"""The ``raykv`` command: ``demo``, ``replay``, ``bench``, ``up``/``status``/``down``/``config``."""
