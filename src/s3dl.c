/*
 * s3dl.c - the S3 client's libraries loaded at run time (AMBER_S3_DLOPEN, src/s3dl.h):
 * the system's libcurl (7.75 or newer: AWS SigV4 signing), expat and zlib, opened
 * with dlopen at the first use of an s3:// store, their functions looked up once.
 * A machine without them gets a clear error at that use; nothing else of the library
 * needs them. AMBER_LIBCURL names another libcurl to load (a path or a soname). In a
 * build that links them, amber__s3_load has nothing to do.
 */
#include "internal.h"

#ifdef AMBER_HAVE_S3
#include "s3dl.h"

#ifdef AMBER_S3_DLOPEN
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

amber__s3syms amber__s3sym;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int loaded;              /* every function found; set once, under `once` */
static char why[AMBER__ERRLEN]; /* else why not */

#define HOW_TO_INSTALL                                                                   \
  "install the system's libcurl, expat and zlib (Debian, Ubuntu: apt install libcurl4 " \
  "libexpat1 zlib1g; RHEL, Fedora: dnf install libcurl expat zlib)"

/* The first of `names` that opens; else NULL, with the reason in why. */
static void *open_first(const char *what, const char *const *names) {
  for (const char *const *n = names; *n; n++) {
    void *h = dlopen(*n, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
  }
  const char *err = dlerror();
  snprintf(why, sizeof why, "s3:// stores need %s at run time, which this machine lacks (%s): %s",
           what, err ? err : names[0], HOW_TO_INSTALL);
  return NULL;
}

/* Looks up `name` in `h` into *slot (a function pointer's storage). */
static int sym(void *h, const char *name, void *slot) {
  void *p = dlsym(h, name);
  if (!p) {
    snprintf(why, sizeof why, "s3:// stores: the system's library lacks %s: %s", name,
             HOW_TO_INSTALL);
    return -1;
  }
  memcpy(slot, &p, sizeof p); /* POSIX: a function's address as dlsym gives it */
  return 0;
}

static void load(void) {
  static const char *const curls[] = {"libcurl.so.4", "libcurl-gnutls.so.4", "libcurl-nss.so.4",
                                      NULL};
  static const char *const expats[] = {"libexpat.so.1", NULL};
  static const char *const zlibs[] = {"libz.so.1", NULL};
  /* AMBER_LIBCURL names the libcurl to load instead (a path, or another name) */
  const char *mine = getenv("AMBER_LIBCURL");
  const char *const chosen[] = {mine, NULL};
  void *c = open_first(mine && *mine ? "the libcurl that AMBER_LIBCURL names" : "libcurl (libcurl.so.4)",
                       mine && *mine ? chosen : curls);
  void *x = NULL, *z = NULL;
  if (c) x = open_first("expat (libexpat.so.1)", expats);
  if (x) z = open_first("zlib (libz.so.1)", zlibs);
  if (!z) return;
  curl_version_info_data *(*version)(CURLversion) = NULL;
  amber__s3syms *t = &amber__s3sym;
  if (sym(c, "curl_version_info", &version) || sym(c, "curl_global_init", &t->global_init) ||
      sym(c, "curl_easy_init", &t->easy_init) || sym(c, "curl_easy_setopt", &t->easy_setopt) ||
      sym(c, "curl_easy_getinfo", &t->easy_getinfo) || sym(c, "curl_easy_reset", &t->easy_reset) ||
      sym(c, "curl_easy_cleanup", &t->easy_cleanup) ||
      sym(c, "curl_easy_strerror", &t->easy_strerror) ||
      sym(c, "curl_multi_init", &t->multi_init) ||
      sym(c, "curl_multi_add_handle", &t->multi_add_handle) ||
      sym(c, "curl_multi_remove_handle", &t->multi_remove_handle) ||
      sym(c, "curl_multi_perform", &t->multi_perform) ||
      sym(c, "curl_multi_poll", &t->multi_poll) ||
      sym(c, "curl_multi_info_read", &t->multi_info_read) ||
      sym(c, "curl_multi_cleanup", &t->multi_cleanup) ||
      sym(c, "curl_share_init", &t->share_init) ||
      sym(c, "curl_share_setopt", &t->share_setopt) ||
      sym(c, "curl_share_cleanup", &t->share_cleanup) ||
      sym(c, "curl_slist_append", &t->slist_append) ||
      sym(c, "curl_slist_free_all", &t->slist_free_all) ||
      sym(x, "XML_ParserCreate", &t->parser_create) ||
      sym(x, "XML_ParserFree", &t->parser_free) ||
      sym(x, "XML_SetUserData", &t->set_user_data) ||
      sym(x, "XML_SetElementHandler", &t->set_element_handler) ||
      sym(x, "XML_SetCharacterDataHandler", &t->set_character_data_handler) ||
      sym(x, "XML_Parse", &t->parse) || sym(z, "crc32", &t->crc32))
    return;
  const curl_version_info_data *v = version(CURLVERSION_NOW);
  if (!v || v->version_num < 0x074b00) { /* 7.75: CURLOPT_AWS_SIGV4 */
    snprintf(why, sizeof why, "s3:// stores need libcurl 7.75 or newer (AWS SigV4 signing); "
             "this machine's is %s", v && v->version ? v->version : "older");
    return;
  }
  loaded = 1;
}

int amber__s3_load(void) {
  pthread_once(&once, load);
  return loaded ? 0 : amber__fail(NULL, AMBER_EFORMAT, "%s", why);
}

#else /* linked: nothing to load */

int amber__s3_load(void) {
  return 0;
}

#endif
#else /* built without S3 */
typedef int amber__s3dl_unused;
#endif
