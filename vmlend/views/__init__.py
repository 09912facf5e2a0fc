"""Rendering shared by the command line and the demo: tables, JSON shapes and text views of
devices, the fabric and VM status. It imports neither ``vmlend.cli`` nor ``vmlend.demo``."""
