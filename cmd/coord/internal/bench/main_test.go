package bench

import (
	"testing"

	"github.com/go-coord/coord/internal/testenv"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// scale stretches every deadline and time bound of the tests for slow
// machines (emulated CPUs), as in package coord's tests:
// COORD_TEST_SCALE=10 allows ten times longer.
var scale = testenv.Scale()
