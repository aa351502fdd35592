package testenv

import (
	"runtime"
	"testing"
	"time"
)

func TestScale(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want time.Duration
	}{
		{"", 1},
		{"1", 1},
		{"10", 10},
		{"3", 3},
		{"0", 1},
		{"-2", 1},
		{"1.5", 1},
		{"ten", 1},
		{" 10", 1},
	} {
		t.Run("COORD_TEST_SCALE="+tc.env, func(t *testing.T) {
			t.Setenv("COORD_TEST_SCALE", tc.env)
			if got := Scale(); got != tc.want {
				t.Fatalf("Scale() = %d, want %d", got, tc.want)
			}
		})
	}
}

func TestEmulator(t *testing.T) {
	// Debian's qemu-user-static names, for the targets CI emulates.
	for cpu, want := range map[string]string{
		"arm64": "qemu-aarch64-static", "loong64": "qemu-loongarch64-static", "ppc64le": "qemu-ppc64le-static",
		"s390x": "qemu-s390x-static", "riscv64": "qemu-riscv64-static",
	} {
		if got := emulatorOf(cpu); got != want {
			t.Errorf("emulatorOf(%q) = %q, want %q", cpu, got, want)
		}
	}
	if got, want := Emulator(), emulatorOf(runtime.GOARCH); got != want {
		t.Fatalf("Emulator() = %q on %s, want %q", got, runtime.GOARCH, want)
	}
}

// The ports an etcd binds again on restart are picked below the kernel's
// ephemeral range, where no outgoing connection can take one meanwhile.
func TestLoopbackPortsAreOutsideTheEphemeralRange(t *testing.T) {
	ports, err := LoopbackPorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(map[int]bool)
	for _, p := range ports {
		if p < lowestPort || p >= ephemeralLow() || seen[p] {
			t.Errorf("port %d: want distinct ports in [%d, %d), got %v", p, lowestPort, ephemeralLow(), ports)
		}
		seen[p] = true
	}
}
