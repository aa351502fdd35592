package coordtest

import "fmt"

// failer is where a Server, Cluster or Proxy reports what it cannot do: the
// testing.TB it was created with, or a panicker for a Server created by
// Start. A testing.TB is used as it is, not wrapped, so that Helper marks
// our methods rather than a wrapper's.
type failer interface {
	Helper()
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Logf(format string, args ...any)
}

// panicker is the failer of a Server started outside a test: where a test
// would fail, it panics with the message the test would have printed.
type panicker struct{}

func (panicker) Helper() {}

func (panicker) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

func (panicker) Errorf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

// Logf discards: a tool has no test log, and what is logged is not a
// failure.
func (panicker) Logf(string, ...any) {}
