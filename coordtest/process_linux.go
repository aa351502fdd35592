package coordtest

import "syscall"

// sysProcAttr has the kernel kill an etcd process when the test binary
// that started it dies, however it dies.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
