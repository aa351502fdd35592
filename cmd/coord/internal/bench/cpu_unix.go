//go:build unix

package bench

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// benchProcessCPU returns the user and system CPU time this process has used.
func benchProcessCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}

// benchProcessRSS returns this process's resident memory now and at its
// peak, in bytes, as /proc tells (0 where it cannot). getrusage's peak
// will not do for a child: it starts from its parent's at the exec.
func benchProcessRSS() (rss, peak int64) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		name, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch name {
		case "VmRSS":
			rss = kb << 10
		case "VmHWM":
			peak = kb << 10
		}
	}
	return rss, peak
}
