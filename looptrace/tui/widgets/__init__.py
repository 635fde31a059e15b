"""Dashboard widgets: one per file, each drawing one panel from a `DashboardModel`."""
