"""Stage tasks, one subpackage per stage family."""
