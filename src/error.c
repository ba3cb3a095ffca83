/*
 * error.c - versions, error codes and messages, and amber_free: the small leaf
 * functions every other part uses. Messages are kept per handle (amber__err at the
 * start of each handle struct) and per thread, so a failed _open can still be
 * explained with amber_last_error(NULL).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local char tls_msg[AMBER__ERRLEN];

uint32_t amber_version(void) {
  return (AMBER_VERSION_MAJOR << 16) | (AMBER_VERSION_MINOR << 8) | AMBER_VERSION_PATCH;
}

const char *amber_version_string(void) {
  return AMBER_VERSION_STRING;
}

const char *amber_strerror(int code) {
  switch (code) {
  case 0:
    return "success";
#define XX(name, value, msg)                                                             \
  case value:                                                                            \
    return msg;
    AMBER_ERRNO_MAP(XX)
#undef XX
  default:
    return "unknown error";
  }
}

const char *amber_err_name(int code) {
  switch (code) {
  case 0:
    return "OK";
#define XX(name, value, msg)                                                             \
  case value:                                                                            \
    return "AMBER_" #name;
    AMBER_ERRNO_MAP(XX)
#undef XX
  default:
    return "AMBER_UNKNOWN";
  }
}

const char *amber_last_error(const void *handle) {
  if (!handle) return tls_msg;
  return ((const amber__err *)handle)->msg;
}

int amber__fail(amber__err *e, int code, const char *fmt, ...) {
  /* Formatted apart first: callers wrap an earlier message ("rank 1: %s" with
   * amber_last_error(NULL), or a handle's own message), which may be the very
   * buffer written here; vsnprintf into its own argument garbles it. */
  char msg[sizeof tls_msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(tls_msg, msg, sizeof tls_msg);
  if (e && e->msg != tls_msg) memcpy(e->msg, msg, sizeof msg);
  return code;
}

void amber__err_adopt(amber__err *e) {
  if (e) memcpy(e->msg, tls_msg, sizeof tls_msg);
}

int amber__errno_code(int err) {
  switch (err) {
  case ENOSPC:
  case EDQUOT:
  case EFBIG:
    return AMBER_ENOSPC;
  case ENOMEM:
    return AMBER_ENOMEM;
  case ENOENT:
  case ENOTDIR:
    return AMBER_ENOENT;
  case EEXIST:
    return AMBER_EEXIST;
  case EACCES:
  case EPERM:
    return AMBER_EPERM;
  case EROFS:
    return AMBER_EREADONLY;
  case EINVAL:
    return AMBER_EINVAL;
  default:
    return AMBER_EIO;
  }
}

void amber_free(void *p) {
  free(p);
}
