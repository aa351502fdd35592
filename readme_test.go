package coord_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestREADMEGoBlocks builds every ```go block of README.md against the
// package as it is, so that the README cannot drift from the API unnoticed.
func TestREADMEGoBlocks(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if err := checkGoBlocks(t, string(readme)); err != nil {
		t.Fatal(err)
	}
}

// goBlock is a fenced ```go block of a Markdown text.
type goBlock struct {
	line int // of its opening fence, from 1
	code string
}

// goBlocks returns the ```go blocks of markdown, in order. Only fences at
// the start of a line count: the README indents none.
func goBlocks(markdown string) []goBlock {
	var blocks []goBlock
	var cur *goBlock
	for i, l := range strings.Split(markdown, "\n") {
		l = strings.TrimRight(l, " \t\r")
		switch {
		case cur == nil && l == "```go":
			cur = &goBlock{line: i + 1}
		case cur != nil && l == "```":
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			cur.code += l + "\n"
		}
	}
	if cur != nil { // unclosed: the rest of the text, which will not build
		blocks = append(blocks, *cur)
	}
	return blocks
}

// readmeStubs declares what the blocks take from the program around them
// and do not declare themselves: the objects of other sections (h is the
// Quick taste's registration, which the ShardSet block uses) and the
// user's own functions. Only their types matter: nothing runs.
const readmeStubs = `package readmecheck

import (
	"context"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	h        *coord.HostLiveness
	live     *coord.HostLiveness
	watcher  *coord.HostWatcher
	election *coord.Election
	shards   *coord.ShardSet
)

func schedule(ctx context.Context, guard clientv3.Cmp) {}

type job struct{ ID, Result string }

func (job) Ack() {}

func jobs(ctx context.Context, shard string) <-chan job { return nil }
`

// readmeBlockHead begins the file of each block: the imports any block
// may use, each used once so that a block that needs none still builds,
// and the function whose body the block is. Its parameters are what every
// agent has at hand: ctx, its life, and cli, its etcd client (the Quick
// taste declares cli again; its err is new, so := assigns the parameter).
const readmeBlockHead = `package readmecheck

import (
	"context"
	"errors"
	"log"
	"net/http"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

var (
	_ = context.Background
	_ = errors.New
	_ = log.Printf
	_ = http.Handle
	_ = time.Second
	_ = coord.HealthHandler
	_ = clientv3.New
	_ = zap.NewNop
)

func block%d(ctx context.Context, cli *clientv3.Client) error {
`

// checkGoBlocks builds the ```go blocks of readme, each as the body of a
// function of its own, in a module of its own (in a temporary directory)
// that requires coord replaced by this directory, with this module's
// go.sum: nothing is fetched, and the build cache is shared. It returns
// what the go command said of the blocks that fail, with their source.
func checkGoBlocks(t *testing.T, readme string) error {
	t.Helper()
	blocks := goBlocks(readme)
	if len(blocks) == 0 {
		return fmt.Errorf("README.md: no ```go block found")
	}
	here, err := os.Getwd()
	gomod, err1 := os.ReadFile("go.mod")
	gosum, err2 := os.ReadFile("go.sum")
	if err := errors.Join(err, err1, err2); err != nil {
		return err
	}
	// The module's own go.mod, renamed, keeps its go line and the versions
	// of clientv3 and zap the blocks import.
	const self = "module github.com/go-coord/coord\n"
	if !strings.HasPrefix(string(gomod), self) {
		return fmt.Errorf("go.mod does not begin with %q", self)
	}
	mod := "module readmecheck\n" + strings.TrimPrefix(string(gomod), self) +
		"\nrequire github.com/go-coord/coord v0.0.0\n\nreplace github.com/go-coord/coord => " + here + "\n"
	dir := t.TempDir()
	files := map[string]string{"go.mod": mod, "go.sum": string(gosum), "stubs.go": readmeStubs}
	for i, b := range blocks {
		// The block ends the function, which returns after it; vet's
		// unreachable check is off for a block that ends in a return.
		files[blockFile(i)] = fmt.Sprintf(readmeBlockHead, i+1) + b.code + "\treturn nil\n}\n"
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			return err
		}
	}

	// The host's go command, wherever the test binary runs (under qemu for
	// another GOARCH it is still the host's): the one of the GOROOT the
	// test was built with, else the PATH's.
	gocmd := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(gocmd); runtime.GOROOT() == "" || err != nil {
		if gocmd, err = exec.LookPath("go"); err != nil {
			return fmt.Errorf("no go command to build the README's blocks with: none in GOROOT %q nor on the PATH", runtime.GOROOT())
		}
	}
	// The child builds for the host, in its own module only.
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "GOOS" && k != "GOARCH" && k != "GOFLAGS" && k != "GOWORK" {
			env = append(env, kv)
		}
	}
	env = append(env, "GOFLAGS=-mod=mod", "GOWORK=off")
	// build first, for all of the compiler's errors; then vet, for the
	// misuses it finds (a printf verb) that still compile.
	for _, args := range [][]string{{"build", "./..."}, {"vet", "-unreachable=false", "./..."}} {
		cmd := exec.Command(gocmd, args...)
		cmd.Dir, cmd.Env = dir, env
		out, err := cmd.CombinedOutput()
		if err == nil {
			continue
		}
		msg := fmt.Sprintf("go %s of the README's ```go blocks failed: %v\n%s", strings.Join(args, " "), err, out)
		shown := false
		for i, b := range blocks {
			if strings.Contains(string(out), blockFile(i)) {
				first := strings.Count(fmt.Sprintf(readmeBlockHead, i+1), "\n") + 1
				msg += fmt.Sprintf("\nREADME block %d (its fence at README.md line %d) fails: its line README.md:%d is line %d of %s, generated:\n%s",
					i+1, b.line, b.line+1, first, blockFile(i), numbered(files[blockFile(i)]))
				shown = true
			}
		}
		if !shown { // the failure is not in a block: show the wrapping
			msg += "\nstubs.go, generated:\n" + numbered(readmeStubs) + "\ngo.mod, generated:\n" + numbered(mod)
		}
		return fmt.Errorf("%s", msg)
	}
	return nil
}

// blockFile names the generated file of the i-th block, from 0.
func blockFile(i int) string { return fmt.Sprintf("block%d.go", i+1) }

// numbered returns text with its lines numbered, as compilers count them.
func numbered(text string) string {
	var b strings.Builder
	for i, l := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		fmt.Fprintf(&b, "%4d  %s\n", i+1, l)
	}
	return b.String()
}
