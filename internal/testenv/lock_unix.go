//go:build linux || darwin || dragonfly || freebsd || netbsd || openbsd

package testenv

import (
	"os"
	"path/filepath"
	"syscall"
)

// lockFile is the file whose bytes stand for the ports reserved by the
// processes that pick them here; opened once, and kept open, since
// closing any descriptor of a file drops the process's locks on it. nil
// if it cannot be opened: then only this process's own picks are known.
var lockFile *os.File

// lockPort takes a write lock on byte port of the lock file, for the
// process's life (POSIX record locks are the process's, and the kernel
// drops them when it ends, however it ends). It reports false only when
// another process holds that byte; where locking fails otherwise, the
// port is taken unguarded. Called with handedOut held.
func lockPort(port int) bool {
	if lockFile == nil {
		f, err := os.OpenFile(filepath.Join(os.TempDir(), "coord-test-ports.lock"), os.O_RDWR|os.O_CREATE, 0o666)
		if err != nil {
			return true
		}
		lockFile = f
	}
	lk := syscall.Flock_t{Type: syscall.F_WRLCK, Whence: 0, Start: int64(port), Len: 1}
	err := syscall.FcntlFlock(lockFile.Fd(), syscall.F_SETLK, &lk)
	return err != syscall.EAGAIN && err != syscall.EACCES
}

// locksAcrossProcesses says whether lockPort reserves across processes.
const locksAcrossProcesses = true
