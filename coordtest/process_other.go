//go:build !linux

package coordtest

import "syscall"

// sysProcAttr: only Linux has a parent-death signal; elsewhere an etcd
// process is killed by the test's cleanup alone.
func sysProcAttr() *syscall.SysProcAttr { return nil }
