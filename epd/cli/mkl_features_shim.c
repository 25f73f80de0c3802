/* MKL's "is this an Intel CPU?" check, answered yes (`epd serve --mkl-dispatch features`,
 * epd/cli/mkl_dispatch.py): MKL then picks its kernels by the CPU's instruction set, as it does on
 * an Intel CPU, instead of its generic ones. Preloaded (LD_PRELOAD), this definition comes before
 * the one torch's libtorch_cpu exports, so MKL's own calls reach it. */
int mkl_serv_intel_cpu_true(void) { return 1; }
