/* UCX glue that stable Rust cannot express: a log handler takes a va_list. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <ucs/debug/log_def.h>

/* UCX prints its log lines to stdout unless UCX_LOG_FILE says otherwise: into the bytes
 * `rdram get` writes, or an application's output. This handler, pushed above UCX's
 * default one, writes them to stderr instead and stops there. */
static ucs_log_func_rc_t rdram_ucx_log_handler(const char *file, unsigned line, const char *function,
                                               ucs_log_level_t level,
                                               const ucs_log_component_config_t *comp_conf,
                                               const char *message, va_list ap)
{
    (void)function;
    if (level != UCS_LOG_LEVEL_PRINT && !ucs_log_component_is_enabled(level, comp_conf))
        return UCS_LOG_FUNC_RC_CONTINUE;
    char text[2048];
    vsnprintf(text, sizeof(text), message, ap);
    const char *base = strrchr(file, '/');
    fprintf(stderr, "[ucx] %s %s:%u %s\n", ucs_log_level_names[level], base ? base + 1 : file, line, text);
    return UCS_LOG_FUNC_RC_STOP;
}

void rdram_ucx_log_to_stderr(void)
{
    ucs_log_push_handler(rdram_ucx_log_handler);
}
