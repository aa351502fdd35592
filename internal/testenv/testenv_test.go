package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
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

// A port is handed out once per process, and not to another process while
// this one holds it: a stopped etcd's port stays its own until it starts
// again. The other process is this test binary run again (see TestMain),
// asking for the ports this one reserved, then picking one of its own.
func TestLoopbackPortsAreReserved(t *testing.T) {
	ports, err := LoopbackPorts(2)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ports {
		if reserve(p) {
			t.Errorf("port %d handed out again in the process that holds it", p)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), fmt.Sprintf("%s=%d,%d", reserveEnv, ports[0], ports[1]))
	out, err := output(env, exe)
	if errors.Is(err, syscall.ENOEXEC) {
		// Under user-mode emulation the kernel may not run it by itself.
		out, err = output(env, Emulator(), exe)
	}
	if err != nil {
		t.Fatalf("the other process: %v\n%s", err, out)
	}
	want := fmt.Sprintf("reserved %d: %v\nreserved %d: %v\npicked another: true\n", ports[0], !locksAcrossProcesses, ports[1], !locksAcrossProcesses)
	if string(out) != want {
		t.Fatalf("the other process's reservations:\n%s\nwant:\n%s", out, want)
	}
}

// output runs name with args and env, and returns what it printed.
func output(env []string, name string, args ...string) ([]byte, error) {
	cmd := exec.Command(name, args...)
	cmd.Env = env
	return cmd.CombinedOutput()
}

// reserveEnv, set, makes the test binary the other process of
// TestLoopbackPortsAreReserved: it tries to reserve the ports it lists
// (comma-separated), says which it got, picks a port of its own, says
// whether it is another, and exits.
const reserveEnv = "COORD_TESTENV_RESERVE"

func TestMain(m *testing.M) {
	if list := os.Getenv(reserveEnv); list != "" {
		var held []int
		for _, f := range strings.Split(list, ",") {
			p, err := strconv.Atoi(f)
			if err != nil {
				fmt.Println(err)
				os.Exit(2)
			}
			held = append(held, p)
			fmt.Printf("reserved %d: %v\n", p, reserve(p))
		}
		own, err := LoopbackPorts(1)
		if err != nil {
			fmt.Println(err)
			os.Exit(2)
		}
		fmt.Printf("picked another: %v\n", !slices.Contains(held, own[0]))
		os.Exit(0)
	}
	os.Exit(m.Run())
}
