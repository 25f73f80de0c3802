"""Imported last by the stack's zygote (`epd.cli.zygote.Zygote` appends it to any preload list): the
zygote lets go of the file pages its imports touched, so that only the services that use a page
keep it mapped.

Why: importing torch, torchvision and transformers faults in ~300 MiB of shared-library pages
(libtorch_cpu, and in the CUDA build of torch libtorch_cuda, cuBLASLt, nvrtc, nvJitLink, triton:
their static initialisers and relocation reads). A forked service gets none of those mappings'
page-table entries (the kernel copies no entries of a file mapping without private pages; the child
faults in what it touches, from the page cache), so the pages no service uses were mapped by the
zygote alone, and whole-server PSS counted all of them (the zygote's PSS on a quiet machine: 420
MiB before, 149 after; docs/benchmarks.md, "Where the peak PSS goes"). The zygote runs nothing but
its fork loop, so those pages are dropped from its page tables with madvise(MADV_DONTNEED): the
files' pages stay in the page cache (a service that needs one maps it with a minor fault, as it did
before), and nothing of the libraries' state changes, because only read-only mappings with no
private (anonymous, copy-on-write) page are touched: where a page was written (relocated data),
MADV_DONTNEED would put back the file's bytes over it.
"""

from epd.cli.zygote import drop_clean_file_pages

drop_clean_file_pages()
