package bench

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Report is a run of the bench as Config.JSON receives it: the figures
// of each row as the table prints them, and what a reader needs to weigh
// them (when, on which code, on how busy a machine).
type Report struct {
	Command string    `json:"command"` // as given, e.g. "coord bench --only 3,8"
	Started time.Time `json:"started"` // UTC
	Took    string    `json:"took"`
	// Commit is the working tree's commit, with "+changes" if it had
	// uncommitted changes; "" where git could not say.
	Commit string `json:"commit"`
	Go     string `json:"go"`
	OS     string `json:"os"`
	Arch   string `json:"arch"`
	CPUs   int    `json:"cpus"`
	// Load is the 1-minute load average at the start and at the end
	// (Linux); "" where unknown.
	Load [2]string `json:"load_average"`
	Etcd string    `json:"etcd"` // the etcd it ran on
	Rows []Row     `json:"rows"`
}

// Row is a row of the table: a scenario (its number first), coord's and
// the plain etcd client's figures, their ratio, and the goal or limit the
// figures are read against.
type Row struct {
	Scenario string `json:"scenario"`
	Coord    string `json:"coord"`
	Plain    string `json:"plain"`
	Ratio    string `json:"ratio"`
	Goal     string `json:"goal"`
}

// loadAverage returns the 1-minute load average, "" where unknown.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// gitCommit returns the working tree's commit (see Report.Commit).
func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		return ""
	}
	commit := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
		commit += "+changes"
	}
	return commit
}

// newReport starts the report of a run.
func newReport(command, etcd string) *Report {
	return &Report{Command: command, Started: time.Now().UTC().Truncate(time.Second), Commit: gitCommit(),
		Go: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(),
		Load: [2]string{loadAverage(), ""}, Etcd: etcd}
}

// writeJSON writes r, indented.
func (r *Report) writeJSON(w io.Writer) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// ReadReport reads a report that Config.JSON received.
func ReadReport(data []byte) (Report, error) {
	var r Report
	if err := json.Unmarshal(data, &r); err != nil {
		return r, fmt.Errorf("bench: a report: %w", err)
	}
	return r, nil
}

// Render prints the table of the figures of reports, in Markdown: each
// scenario's rows from the latest report that has them (by Started), in
// scenario order, each with the run it comes from; then the runs, each
// with its command, date, commit, machine and load average.
func Render(w io.Writer, reports []Report) {
	reports = slices.Clone(reports)
	slices.SortStableFunc(reports, func(a, b Report) int { return a.Started.Compare(b.Started) })
	// The latest run of each scenario number (without its letter).
	latest := map[int]int{}
	for i, r := range reports {
		for _, row := range r.Rows {
			if n := scenarioNumber(row); n > 0 {
				latest[n] = i
			}
		}
	}
	// The runs the table uses, named A, B, … by date.
	names := map[int]string{}
	for _, i := range slices.Sorted(maps.Values(latest)) {
		if names[i] == "" {
			names[i] = string(rune('A' + len(names)%26))
		}
	}
	fmt.Fprintln(w, "| scenario | coord | plain etcd | ratio | goal or limit | run |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- |")
	for _, n := range slices.Sorted(maps.Keys(latest)) {
		i := latest[n]
		for _, row := range reports[i].Rows {
			if scenarioNumber(row) == n {
				fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", cell(row.Scenario), cell(row.Coord), cell(row.Plain),
					cell(row.Ratio), cell(row.Goal), names[i])
			}
		}
	}
	fmt.Fprintln(w)
	for i, r := range reports {
		if names[i] == "" {
			continue
		}
		fmt.Fprintf(w, "- **Run %s**: `%s`, started %s, took %s; commit %s; %s, %d cores, %s %s/%s; load average %s at the start, %s at the end.\n",
			names[i], r.Command, r.Started.Format("2006-01-02 15:04 UTC"), r.Took, cmp.Or(r.Commit, "unknown"), r.Etcd,
			r.CPUs, r.Go, r.OS, r.Arch, cmp.Or(r.Load[0], "unknown"), cmp.Or(r.Load[1], "unknown"))
	}
}

// scenarioNumber returns the number of row's scenario without its
// letter (3 of "3b. Resign …"), 0 if it names none.
func scenarioNumber(row Row) int {
	n, _, _ := strings.Cut(row.Scenario, ". ")
	v, err := strconv.Atoi(strings.TrimRight(n, "abcdefghijklmnopqrstuvwxyz"))
	if err != nil || v < 1 {
		return 0
	}
	return v
}

// cell escapes s for a cell of a Markdown table.
func cell(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "|", `\|`), "\n", " ")
}
