//go:build !(linux || darwin || dragonfly || freebsd || netbsd || openbsd)

package testenv

// lockPort reserves nothing across processes where there are no POSIX
// record locks: only this process's own picks are known.
func lockPort(int) bool { return true }

// locksAcrossProcesses says whether lockPort reserves across processes.
const locksAcrossProcesses = false
