package bench

import (
	"os"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// scale stretches every deadline and time bound of the tests for slow
// machines (emulated CPUs), as in package coord's tests:
// COORD_TEST_SCALE=10 allows ten times longer.
var scale = func() time.Duration {
	n, err := strconv.Atoi(os.Getenv("COORD_TEST_SCALE"))
	if err != nil || n < 1 {
		return 1
	}
	return time.Duration(n)
}()
