// Package testenv says what the module's tests and its bench need to know
// about the machine they run on: how much slower than a native CPU it may
// be, which user-mode emulator runs a binary of this GOARCH (CI tests
// five of the six targets under qemu), and which loopback ports an etcd
// can bind again after a restart.
package testenv

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
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

// An etcd stopped and started again (restarted, replaced, restored) binds
// the same ports again. A port inside the kernel's ephemeral range, the
// local ports it hands to outgoing connections, can meanwhile become the
// local port of any connection on the machine, for as long as that
// connection lives: once, with several test binaries running, a restart
// found its port taken for longer than the 5 s it waits. So the ports are
// picked below that range, where only a listener that names its port can
// take one.

// lowestPort is the lowest port picked.
const lowestPort = 10000

// ephemeralLow returns the first port of the kernel's ephemeral range:
// Linux's, from procfs, or else that of IANA's dynamic ports, which the
// BSDs, macOS and Windows use.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	var lo, hi int
	if err == nil {
		if _, err := fmt.Sscan(string(b), &lo, &hi); err == nil {
			return lo
		}
	}
	return 49152
}

// A port is free only while nobody listens on it: the port of an etcd
// stopped for a while is free too, and another server picking ports then
// could take it, in this process or in another test binary running beside
// it (once, the suite's clients then reached something else at the
// stopped etcd's address, and its restart found the port taken). So a
// port is handed out once per process, and reserved for the process's
// life against every other process that picks ports here: a lock on the
// port's byte of a file in the system's temporary directory, which the
// kernel drops when the process ends (see lockPort).

// handedOut holds the ports this process handed out.
var handedOut struct {
	sync.Mutex
	ports map[int]bool
}

// reserve reserves port for this process, unless it was handed out here
// already or another process holds it.
func reserve(port int) bool {
	handedOut.Lock()
	defer handedOut.Unlock()
	if handedOut.ports[port] || !lockPort(port) {
		return false
	}
	if handedOut.ports == nil {
		handedOut.ports = map[int]bool{}
	}
	handedOut.ports[port] = true
	return true
}

// LoopbackPorts returns n distinct TCP ports that were free on 127.0.0.1
// a moment ago, below the ephemeral range when it leaves at least a
// thousand ports there, else picked by the kernel. No port is returned
// twice in a process, nor while another process that uses LoopbackPorts
// holds it (where file locks allow: Linux, macOS, the BSDs).
func LoopbackPorts(n int) ([]int, error) {
	window := ephemeralLow() - lowestPort
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		addr := "127.0.0.1:0"
		if window >= 1000 && tries < 100*n {
			addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(lowestPort+rand.IntN(window)))
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			if errors.Is(err, syscall.EADDRINUSE) {
				continue
			}
			return nil, fmt.Errorf("picking a free loopback port: %w", err)
		}
		// Free a moment ago; the reservation keeps the ports distinct.
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if reserve(port) {
			ports = append(ports, port)
		}
	}
	return ports, nil
}
