/* Which kernel versions this CPU can execute (compiled once, for the baseline). The x86
   versions are compiled for the x86-64 levels of the same names (build.py), so the check is
   the level's own: every feature the compiler may use at that level, the operating system's
   support for the wider registers included (gcc's cpu model checks XCR0). */
#include <stdint.h>
#include <string.h>

#include "pagechat_cpu.h"

#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for an extended state component */
#define XFEATURE_XTILEDATA 18      /* the AMX tile data */
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

/* 1 where the version named `isa` runs on this CPU, 0 where not or where the name is not a
   version of this architecture. */
int64_t pc_cpu_runs(const char *isa) {
    if (strcmp(isa, "generic") == 0)
        return 1;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("x86-64-v3") > 0;
    if (strcmp(isa, "avx512") == 0)
        return __builtin_cpu_supports("x86-64-v4") > 0;
    const int vnni =
        __builtin_cpu_supports("x86-64-v4") > 0 && __builtin_cpu_supports("avx512vnni") > 0;
    if (strcmp(isa, "vnni") == 0)
        return vnni;
    if (strcmp(isa, "amx") == 0) {
        /* Linux hands out the tile registers' state only to a process that asks for it (once;
           every thread then has it): no permission, no AMX, whatever cpuid says. */
        return vnni && __builtin_cpu_supports("amx-tile") > 0 &&
               __builtin_cpu_supports("amx-bf16") > 0 && __builtin_cpu_supports("amx-int8") > 0 &&
               syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
#elif defined(__aarch64__)
    if (strcmp(isa, "neon") == 0) {
        const unsigned long caps = getauxval(AT_HWCAP);
        return (caps & HWCAP_ASIMD) && (caps & HWCAP_ASIMDDP);
    }
#endif
    return 0;
}
