module coordci/report

go 1.22
