package coord_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/go-coord/coord/coordtest"
)

// TestREADMEGoBlocks builds every ```go block of README.md against the
// package as it is, so that the README cannot drift from the API unnoticed,
// then runs them in order against an embedded etcd (see readmeRun).
func TestREADMEGoBlocks(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlocks(string(readme))
	if len(blocks) == 0 {
		t.Fatal("README.md: no ```go block found")
	}
	// The blocks run on the host, whatever GOARCH this test is built for:
	// under emulation, their run would repeat the host's own.
	endpoint := ""
	if onHost(t) {
		endpoint = coordtest.NewServer(t).Endpoint()
	} else {
		t.Logf("README.md: the blocks are built, not run, under emulation (GOARCH %s): they run in the host's own test", runtime.GOARCH)
	}
	if err := checkGoBlocks(t, "README.md", blocks, endpoint); err != nil {
		t.Fatal(err)
	}
}

// onHost reports whether this test runs on the host's own GOARCH, that of
// the go command that builds the blocks.
func onHost(t *testing.T) bool {
	gocmd, err := goCommand()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(gocmd, "env", "GOHOSTARCH").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out)) == runtime.GOARCH
}

// goCommand returns the host's go command, wherever the test binary runs
// (under qemu for another GOARCH it is still the host's): the one of the
// GOROOT the test was built with, else the PATH's.
func goCommand() (string, error) {
	gocmd := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(gocmd); runtime.GOROOT() == "" || err != nil {
		if gocmd, err = exec.LookPath("go"); err != nil {
			return "", fmt.Errorf("no go command to build the blocks with: none in GOROOT %q nor on the PATH", runtime.GOROOT())
		}
	}
	return gocmd, nil
}

// TestDocsGoBlocks builds the ```go blocks of each page of docs/ as
// TestREADMEGoBlocks does the README's, a subtest per page. A page
// without a block passes.
func TestDocsGoBlocks(t *testing.T) {
	for _, page := range docsPages(t) {
		t.Run(filepath.Base(page), func(t *testing.T) {
			text, err := os.ReadFile(page)
			if err != nil {
				t.Fatal(err)
			}
			blocks := goBlocks(string(text))
			if len(blocks) == 0 {
				t.Logf("%s: no ```go block", page)
				return
			}
			if err := checkGoBlocks(t, page, blocks, ""); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// docsPages returns the Markdown pages of docs/, sorted; there must be
// some, or the tests over them would pass on nothing.
func docsPages(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob(filepath.Join("docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) == 0 {
		t.Fatal("docs/: no .md page found")
	}
	slices.Sort(pages)
	return pages
}

// TestDocsLinks checks every relative link of README.md and of the pages
// of docs/: its file (or directory) must exist in the repository, and an
// anchor after '#' into a Markdown file must name one of its headings, as
// GitHub makes their anchors. Links with a scheme (https:, mailto:) are
// not followed.
func TestDocsLinks(t *testing.T) {
	anchors := map[string][]string{} // of each Markdown file read, by path
	anchorsOf := func(path string) ([]string, error) {
		if a, ok := anchors[path]; ok {
			return a, nil
		}
		text, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		anchors[path] = headingAnchors(string(text))
		return anchors[path], nil
	}
	checked := 0
	for _, page := range append([]string{"README.md"}, docsPages(t)...) {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range markdownLinks(string(text)) {
			if scheme.MatchString(l.dest) {
				continue
			}
			checked++
			file, frag, _ := strings.Cut(l.dest, "#")
			target := page // a bare #anchor is into the page itself
			switch {
			case strings.HasPrefix(file, "/"): // from the repository's root, as GitHub reads it
				target = filepath.Join(".", filepath.FromSlash(file))
			case file != "":
				target = filepath.Join(filepath.Dir(page), filepath.FromSlash(file))
			}
			// target is relative to the repository's root (filepath.Join
			// cleans it): one that begins with .. leaves the repository,
			// even if it comes back into a directory of the same name.
			if target == ".." || strings.HasPrefix(target, ".."+string(filepath.Separator)) || filepath.IsAbs(target) {
				t.Errorf("%s:%d: link %q points outside the repository", page, l.line, l.dest)
				continue
			}
			if _, err := os.Stat(target); err != nil {
				t.Errorf("%s:%d: link %q: no such file in the repository (%s)", page, l.line, l.dest, target)
				continue
			}
			if frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			have, err := anchorsOf(target)
			if err != nil {
				t.Errorf("%s:%d: link %q: %v", page, l.line, l.dest, err)
				continue
			}
			if !slices.Contains(have, frag) {
				t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s; it has: %s",
					page, l.line, l.dest, target, frag, strings.Join(have, " "))
			}
		}
	}
	if checked == 0 {
		t.Fatal("no relative link found in README.md and docs/: the link check checked nothing")
	}
	t.Logf("%d relative links checked", checked)
}

// TestDocsLinkParsing checks what TestDocsLinks relies on: the links it
// finds (none in code) and the anchors it computes for headings.
func TestDocsLinkParsing(t *testing.T) {
	text := strings.Join([]string{
		"See [a](x.md), [`b`](y.md#Sec) and `[not](code.md)` or ``[not](`code`.md)``.",
		"![img](pic.png \"title\") [web](https://example.com) [angle](<sp ace.md>)",
		"[ref]: ref.md",
		"```go",
		"[not](fenced.md)",
		"```",
		"~~~~",
		"```",
		"[not](fenced-too.md)",
		"~~~~",
		"[after](z.md)",
	}, "\n")
	var got []string
	for _, l := range markdownLinks(text) {
		got = append(got, fmt.Sprintf("%d:%s", l.line, l.dest))
	}
	want := []string{"1:x.md", "1:y.md#Sec", "2:pic.png", "2:https://example.com", "2:sp ace.md", "3:ref.md", "11:z.md"}
	if !slices.Equal(got, want) {
		t.Errorf("markdownLinks = %q, want %q", got, want)
	}

	headings := strings.Join([]string{
		"# coord",
		"## An operator's `del --prefix`",
		"## Lost quorum, a leader change",
		"## Dup",
		"## Dup",
		"### [Linked](x.md) text",
		"## C# ##",
		"#not a heading",
		"    # indented code",
		"```",
		"# a comment in code",
		"```",
	}, "\n")
	gotA := headingAnchors(headings)
	wantA := []string{"coord", "an-operators-del---prefix", "lost-quorum-a-leader-change", "dup", "dup-1", "linked-text", "c"}
	if !slices.Equal(gotA, wantA) {
		t.Errorf("headingAnchors = %q, want %q", gotA, wantA)
	}
}

// scheme matches a link destination with a URL scheme: not a file of the
// repository.
var scheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)

// mdLink is a link of a Markdown text.
type mdLink struct {
	line int // from 1
	dest string
}

var (
	// An inline link or image, [text](dest "title"): its destination.
	inlineLink = regexp.MustCompile(`\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:"[^"]*"|'[^']*'))?\s*\)`)
	// A link reference definition, [label]: dest.
	refLink = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)`)
)

// markdownLinks returns the link destinations of markdown, outside fenced
// code blocks and code spans, in order.
func markdownLinks(markdown string) []mdLink {
	var links []mdLink
	var f fences
	for i, l := range strings.Split(markdown, "\n") {
		if f.code(l) {
			continue
		}
		l = withoutCodeSpans(l)
		for _, m := range inlineLink.FindAllStringSubmatch(l, -1) {
			links = append(links, mdLink{i + 1, strings.Trim(m[1], "<>")})
		}
		if m := refLink.FindStringSubmatch(l); m != nil {
			links = append(links, mdLink{i + 1, strings.Trim(m[1], "<>")})
		}
	}
	return links
}

// fences follows the fenced code blocks of a Markdown text, line by line.
type fences struct{ open string } // the fence of the block we are in, if any

// code says whether line belongs to a fenced code block: its opening
// fence (``` or ~~~, or longer, indented 3 spaces at most), its closing
// one (the same character, at least as long, and nothing after it) or
// a line in between.
func (f *fences) code(line string) bool {
	l := strings.TrimLeft(line, " ")
	fence := ""
	if len(line)-len(l) <= 3 {
		for _, c := range []string{"`", "~"} {
			if n := len(l) - len(strings.TrimLeft(l, c)); n >= 3 {
				fence = l[:n]
			}
		}
	}
	switch {
	case f.open == "":
		f.open = fence
		return fence != ""
	case fence != "" && fence[0] == f.open[0] && len(fence) >= len(f.open) && strings.TrimSpace(l[len(fence):]) == "":
		f.open = ""
	}
	return true
}

// withoutCodeSpans returns line without its code spans (a run of
// backticks, up to the next run of as many), whose text is not Markdown.
func withoutCodeSpans(line string) string {
	var b strings.Builder
	for {
		i := strings.IndexByte(line, '`')
		if i < 0 {
			return b.String() + line
		}
		b.WriteString(line[:i])
		n := len(line[i:]) - len(strings.TrimLeft(line[i:], "`"))
		run, rest := line[i:i+n], line[i+n:]
		end := -1
		for j := 0; j < len(rest); {
			k := strings.Index(rest[j:], run)
			if k < 0 {
				break
			}
			k += j
			m := len(rest[k:]) - len(strings.TrimLeft(rest[k:], "`"))
			if m == n {
				end = k
				break
			}
			j = k + m
		}
		if end < 0 { // no closing run: the backticks are text
			b.WriteString(run)
			line = rest
			continue
		}
		line = rest[end+n:]
	}
}

// headingAnchors returns the anchors GitHub gives the ATX headings of
// markdown (outside fenced code blocks): the heading's text without its
// Markdown (code spans' backticks, links' destinations), lower-cased,
// every character but letters, digits, spaces, '-' and '_' dropped,
// spaces turned into '-'; a repeated anchor gets -1, -2, ….
func headingAnchors(markdown string) []string {
	var anchors []string
	seen := map[string]int{}
	var f fences
	for _, l := range strings.Split(markdown, "\n") {
		if f.code(l) {
			continue
		}
		t := strings.TrimLeft(l, " ")
		level := len(t) - len(strings.TrimLeft(t, "#"))
		if level < 1 || level > 6 || len(l)-len(t) > 3 || (len(t) > level && t[level] != ' ' && t[level] != '\t') {
			continue
		}
		text := strings.TrimSpace(t[level:])
		if c := strings.TrimRight(text, "#"); c == "" || strings.HasSuffix(c, " ") || strings.HasSuffix(c, "\t") {
			text = strings.TrimSpace(c) // a closing sequence of #s
		}
		text = markdownLinkText.ReplaceAllString(text, "$1")
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteRune('-')
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			seen[a]++
			a = fmt.Sprintf("%s-%d", a, n)
		} else {
			seen[a] = 1
		}
		anchors = append(anchors, a)
	}
	return anchors
}

// markdownLinkText matches an inline link, its text in the first group.
var markdownLinkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)

// TestREADMELength keeps the README what a newcomer reads in ten
// minutes: at most readmeLines lines; the rest belongs in docs/.
func TestREADMELength(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(readme), "\n"); n > readmeLines {
		t.Errorf("README.md has %d lines, want at most %d: move the detail to a page of docs/", n, readmeLines)
	}
}

const readmeLines = 250

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
// Quick taste's registration, which the ShardSet block uses), the test of
// a block about testing (t), and the user's own functions. The README's
// blocks also run (see readmeRun): its functions do then what the blocks
// ask of them; the pages' blocks are only built.
const readmeStubs = `package readmecheck

import (
	"context"
	"errors"
	"testing"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

var (
	h        *coord.HostLiveness
	live     *coord.HostLiveness
	watcher  *coord.HostWatcher
	election *coord.Election
	shards   *coord.ShardSet
	t        *testing.T

	readmeEndpoint string // the etcd the blocks run against (see run_test.go)
	scheduled      = make(chan error, 1)
)

// schedule is the leader's work of the Quick taste: a write fenced by
// guard; the agent's life ends after it, and the block returns.
func schedule(ctx context.Context, guard clientv3.Cmp) {
	cli := ctx.Value(cliKey{}).(*clientv3.Client)
	resp, err := cli.Txn(ctx).If(guard).Then(clientv3.OpPut("/readme/scheduled", "yes")).Commit()
	if err == nil && !resp.Succeeded {
		err = errors.New("refused by the fence")
	}
	scheduled <- err
	ctx.Value(endKey{}).(context.CancelFunc)()
}

// The keys of what the run puts in the blocks' ctx for the stubs.
type (
	cliKey struct{}
	endKey struct{}
)

type job struct{ ID, Result string }

func (job) Ack() {}

// jobs is the shard's work: none, until ctx ends.
func jobs(ctx context.Context, shard string) <-chan job {
	c := make(chan job)
	go func() {
		<-ctx.Done()
		close(c)
	}()
	return c
}
`

// readmeRun runs the README's blocks in order, as one agent would: the
// Quick taste (it registers its own host, campaigns, schedules once, and
// ends), then each primitive's block on a registration of ours, h, next to
// another member of the ShardSet's shards, to drain to. Each block must
// return nil, and the leader's write must pass its fence.
const readmeRun = `package readmecheck

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

func TestREADMERun(t *testing.T) {
	readmeEndpoint = os.Getenv("COORD_README_ETCD")
	base, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{readmeEndpoint}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	life, end := context.WithCancel(context.WithValue(base, cliKey{}, cli))
	if err := block1(context.WithValue(life, endKey{}, end), cli); err != nil {
		t.Fatalf("block 1: %v", err)
	}
	select {
	case err := <-scheduled:
		if err != nil {
			t.Fatalf("block 1: the leader's fenced write: %v", err)
		}
	default:
		t.Fatal("block 1 returned without leading")
	}
	reg := func(id string) *coord.HostLiveness {
		r, err := coord.RegisterHostLiveness(base, cli, coord.HostMetadata{HostUUID: id}, coord.LivenessOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Stop(context.Background()) })
		return r
	}
	h = reg("node-1")
	other, err := coord.NewShardSet(base, cli, coord.ShardOptions{Shards: []string{"tenant-1", "tenant-2", "tenant-3"}, Host: reg("node-2"),
		Run: func(ctx context.Context, _ coord.Shard) { <-ctx.Done() }})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	for i, block := range []func(context.Context, *clientv3.Client) error{block2, block3, block4, block5} {
		if err := block(base, cli); err != nil {
			t.Fatalf("block %d: %v", i+2, err)
		}
	}
}
`

// readmeBlockHead begins the file of each block: the imports any block
// may use, each used once so that a block that needs none still builds,
// and the function whose body the block is. Its parameters are what every
// agent has at hand: ctx, its life, and cli, its etcd client (the Quick
// taste declares cli again; its err is new, so := assigns the parameter).
// Its verbs are for blockHead.
const readmeBlockHead = `package readmecheck

import (
	"context"
	"errors"
	"log"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-coord/coord"%s
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

var (
	_ = context.Background
	_ = errors.New
	_ = log.Printf
	_ = slog.Default
	_ = http.Handle
	_ = time.Second
	_ = coord.HealthHandler%s
	_ = clientv3.New
	_ = zap.NewNop
)

func block%d(ctx context.Context, cli *clientv3.Client) error {
`

// checkGoBlocks builds blocks, the ```go blocks of the Markdown file
// named page, each as the body of a function of its own, in a module of
// its own (in a temporary directory) that requires coord replaced by this
// directory, with this module's go.sum: nothing is fetched, and the build
// cache is shared. With an etcd endpoint, it then runs the blocks in
// order against that etcd (readmeRun: the README's). It returns what the
// go command said of the blocks that fail, with their source.
func checkGoBlocks(t *testing.T, page string, blocks []goBlock, endpoint string) error {
	t.Helper()
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
		// The etcd a block dials is the one it runs against.
		code := strings.ReplaceAll(b.code, `"127.0.0.1:2379"`, "readmeEndpoint")
		files[blockFile(i)] = blockHead(i, code) + code + "\treturn nil\n}\n"
	}
	steps := [][]string{{"build", "./..."}, {"vet", "-unreachable=false", "./..."}}
	if endpoint != "" {
		files["run_test.go"] = readmeRun
		steps = append(steps, []string{"test", "-count=1", "-run", "TestREADMERun", "./..."})
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			return err
		}
	}

	gocmd, err := goCommand()
	if err != nil {
		return fmt.Errorf("%s: %w", page, err)
	}
	// The child builds for the host, in its own module only.
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "GOOS" && k != "GOARCH" && k != "GOFLAGS" && k != "GOWORK" {
			env = append(env, kv)
		}
	}
	env = append(env, "GOFLAGS=-mod=mod", "GOWORK=off", "COORD_README_ETCD="+endpoint)
	// build first, for all of the compiler's errors; then vet, for the
	// misuses it finds (a printf verb) that still compile; then the run.
	for _, args := range steps {
		cmd := exec.Command(gocmd, args...)
		cmd.Dir, cmd.Env = dir, env
		out, err := cmd.CombinedOutput()
		if err == nil {
			continue
		}
		msg := fmt.Sprintf("go %s of the ```go blocks of %s failed: %v\n%s", strings.Join(args, " "), page, err, out)
		shown := false
		for i, b := range blocks {
			if strings.Contains(string(out), blockFile(i)) {
				first := strings.Count(blockHead(i, b.code), "\n") + 1
				msg += fmt.Sprintf("\n%s block %d (its fence at line %d) fails: its line %s:%d is line %d of %s, generated:\n%s",
					page, i+1, b.line, page, b.line+1, first, blockFile(i), numbered(files[blockFile(i)]))
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

// blockHead returns the head of the file of the i-th block, from 0, whose
// code is code. Only a block that uses coordtest imports it: it brings in
// etcd's server, long to compile where the build cache does not have it.
func blockHead(i int, code string) string {
	imp, use := "", ""
	if strings.Contains(code, "coordtest.") {
		imp, use = "\n\t\"github.com/go-coord/coord/coordtest\"", "\n\t_ = coordtest.NewServer"
	}
	return fmt.Sprintf(readmeBlockHead, imp, use, i+1)
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
