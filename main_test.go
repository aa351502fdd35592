package coord

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// childEnv, when set, makes the test binary a helper process that a test
// started (see sdStartChild): it runs the main of that role instead of the
// tests, and exits.
const childEnv = "COORD_TEST_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// runChild runs the main of a helper process's role and returns its exit
// status.
func runChild(role string) int {
	switch role {
	case sdChildRole:
		return sdChild()
	case smChildRole:
		return smChild()
	}
	fmt.Fprintf(os.Stderr, "%s=%q: no such helper process\n", childEnv, role)
	return 2
}
