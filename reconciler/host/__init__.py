"""The host layer: the only code that reads or writes /sys and /proc, always below a root
directory passed in; the host is probed once (:mod:`.probe`) and the result handed down."""
