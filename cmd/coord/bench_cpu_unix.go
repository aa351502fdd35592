//go:build unix

package main

import (
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
