/*
 * s3dl.h - internal: the S3 client's libraries (libcurl, expat, zlib) linked, or, in a
 * build with AMBER_S3_DLOPEN (the wheel's: a libcurl linked in would carry OpenSSL
 * and its own dependencies into the wheel), loaded at run time from the system's
 * shared libraries (src/s3dl.c). Include it after <curl/curl.h>, <expat.h> and
 * <zlib.h>: in a run-time build it makes each call of theirs that the client uses go
 * through the table of functions amber__s3_load filled.
 */
#ifndef AMBER_S3DL_H
#define AMBER_S3DL_H

/* 0 once the libraries can be called (always, when they are linked); else
 * AMBER_EFORMAT, with a message that names what is missing and how to install it. */
int amber__s3_load(void);

#ifdef AMBER_S3_DLOPEN
#include <curl/curl.h>
#include <expat.h>
#include <zlib.h>

typedef struct amber__s3syms {
  CURLcode (*global_init)(long);
  CURL *(*easy_init)(void);
  CURLcode (*easy_setopt)(CURL *, CURLoption, ...);
  CURLcode (*easy_getinfo)(CURL *, CURLINFO, ...);
  void (*easy_reset)(CURL *);
  void (*easy_cleanup)(CURL *);
  const char *(*easy_strerror)(CURLcode);
  CURLM *(*multi_init)(void);
  CURLMcode (*multi_add_handle)(CURLM *, CURL *);
  CURLMcode (*multi_remove_handle)(CURLM *, CURL *);
  CURLMcode (*multi_perform)(CURLM *, int *);
  CURLMcode (*multi_poll)(CURLM *, struct curl_waitfd *, unsigned int, int, int *);
  CURLMsg *(*multi_info_read)(CURLM *, int *);
  CURLMcode (*multi_cleanup)(CURLM *);
  CURLSH *(*share_init)(void);
  CURLSHcode (*share_setopt)(CURLSH *, CURLSHoption, ...);
  CURLSHcode (*share_cleanup)(CURLSH *);
  struct curl_slist *(*slist_append)(struct curl_slist *, const char *);
  void (*slist_free_all)(struct curl_slist *);
  XML_Parser (*parser_create)(const XML_Char *);
  void (*parser_free)(XML_Parser);
  void (*set_user_data)(XML_Parser, void *);
  void (*set_element_handler)(XML_Parser, XML_StartElementHandler, XML_EndElementHandler);
  void (*set_character_data_handler)(XML_Parser, XML_CharacterDataHandler);
  enum XML_Status (*parse)(XML_Parser, const char *, int, int);
  uLong (*crc32)(uLong, const Bytef *, uInt);
} amber__s3syms;

extern amber__s3syms amber__s3sym;

/* curl.h defines some of these as macros of its own (type checks): ours replace them. */
#undef curl_easy_setopt
#undef curl_easy_getinfo
#undef curl_share_setopt
#define curl_global_init(...) amber__s3sym.global_init(__VA_ARGS__)
#define curl_easy_init(...) amber__s3sym.easy_init(__VA_ARGS__)
#define curl_easy_setopt(...) amber__s3sym.easy_setopt(__VA_ARGS__)
#define curl_easy_getinfo(...) amber__s3sym.easy_getinfo(__VA_ARGS__)
#define curl_easy_reset(...) amber__s3sym.easy_reset(__VA_ARGS__)
#define curl_easy_cleanup(...) amber__s3sym.easy_cleanup(__VA_ARGS__)
#define curl_easy_strerror(...) amber__s3sym.easy_strerror(__VA_ARGS__)
#define curl_multi_init(...) amber__s3sym.multi_init(__VA_ARGS__)
#define curl_multi_add_handle(...) amber__s3sym.multi_add_handle(__VA_ARGS__)
#define curl_multi_remove_handle(...) amber__s3sym.multi_remove_handle(__VA_ARGS__)
#define curl_multi_perform(...) amber__s3sym.multi_perform(__VA_ARGS__)
#define curl_multi_poll(...) amber__s3sym.multi_poll(__VA_ARGS__)
#define curl_multi_info_read(...) amber__s3sym.multi_info_read(__VA_ARGS__)
#define curl_multi_cleanup(...) amber__s3sym.multi_cleanup(__VA_ARGS__)
#define curl_share_init(...) amber__s3sym.share_init(__VA_ARGS__)
#define curl_share_setopt(...) amber__s3sym.share_setopt(__VA_ARGS__)
#define curl_share_cleanup(...) amber__s3sym.share_cleanup(__VA_ARGS__)
#define curl_slist_append(...) amber__s3sym.slist_append(__VA_ARGS__)
#define curl_slist_free_all(...) amber__s3sym.slist_free_all(__VA_ARGS__)
#define XML_ParserCreate(...) amber__s3sym.parser_create(__VA_ARGS__)
#define XML_ParserFree(...) amber__s3sym.parser_free(__VA_ARGS__)
#define XML_SetUserData(...) amber__s3sym.set_user_data(__VA_ARGS__)
#define XML_SetElementHandler(...) amber__s3sym.set_element_handler(__VA_ARGS__)
#define XML_SetCharacterDataHandler(...) amber__s3sym.set_character_data_handler(__VA_ARGS__)
#define XML_Parse(...) amber__s3sym.parse(__VA_ARGS__)
#define crc32(...) amber__s3sym.crc32(__VA_ARGS__)
#endif

#endif /* AMBER_S3DL_H */
