/* Stub of libnvinfer_plugin.so.11 for importing the TensorRT 11.4 Python bindings without TensorRT (see nvinfer.c). */
#include <stdbool.h>

bool initLibNvInferPlugins(void *logger, const char *lib_namespace) { (void)logger; (void)lib_namespace; return false; }
