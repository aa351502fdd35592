// Package testenv says what the module's tests and its bench need to know
// about the machine they run on: how much slower than a native CPU it may
// be, and which user-mode emulator runs a binary of this GOARCH (CI tests
// five of the six targets under qemu).
package testenv

import (
	"os"
	"runtime"
	"strconv"
	"time"
)

// Scale returns how much to stretch deadlines and time bounds on a slow
// machine (an emulated CPU): COORD_TEST_SCALE=10 allows ten times longer.
// It is 1 when COORD_TEST_SCALE is unset or not a whole number above 0.
// Deadlines bound waits on events; nothing should sleep for them.
func Scale() time.Duration {
	n, err := strconv.Atoi(os.Getenv("COORD_TEST_SCALE"))
	if err != nil || n < 1 {
		return 1
	}
	return time.Duration(n)
}

// Emulator names qemu's user-mode emulator of this GOARCH (as Debian's
// qemu-user-static installs it), for running a child process of this
// binary where the kernel cannot run it by itself.
func Emulator() string { return emulatorOf(runtime.GOARCH) }

// emulatorOf names the emulator of GOARCH cpu: qemu's names for the CPUs,
// where they are not Go's.
func emulatorOf(cpu string) string {
	switch cpu {
	case "arm64":
		cpu = "aarch64"
	case "loong64":
		cpu = "loongarch64"
	}
	return "qemu-" + cpu + "-static"
}
