package coordtest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// orphanEnv, when set, makes TestProcessOrphan the helper process of
// TestProcessDiesWithTestBinary: it starts a Process, prints its pid and
// waits to be killed.
const orphanEnv = "COORDTEST_ORPHAN"

func TestProcessOrphan(t *testing.T) {
	if os.Getenv(orphanEnv) == "" {
		return // only as a helper process
	}
	p := NewProcess(t, etcdBinary(t), Config{})
	p.lifeMu.Lock()
	fmt.Printf("pid %d\n", p.cmd.Process.Pid)
	p.lifeMu.Unlock()
	select {}
}

func TestProcessDiesWithTestBinary(t *testing.T) {
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"-test.run=^TestProcessOrphan$", "-test.v"}
	cmd := exec.Command(bin, args...)
	if err := exec.Command(bin, "-test.run=^$").Run(); errors.Is(err, syscall.ENOEXEC) {
		cmd = exec.Command(etcdEmulator(t), append([]string{bin}, args...)...)
	}
	// The helper dies without cleanup: its temporary directories go in
	// one of this test's, removed with it.
	cmd.Env = append(os.Environ(), orphanEnv+"=1", selfEtcdEnv+"=", "TMPDIR="+t.TempDir())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	var pid int
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "pid %d", &pid); err == nil {
			break
		}
	}
	if pid == 0 {
		t.Fatal("the helper process printed no pid")
	}
	// The test binary dies without any cleanup: its etcd must go too.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("etcd (pid %d) outlived the test binary that started it", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
