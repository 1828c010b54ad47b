"""Engines that run batchline's jobs on other systems (``batchline[ray]``).

Nothing is imported here: ``import batchline.integrations.ray`` imports Ray, and only that.
"""
